"""Precision checks: FP8 needs Transformer Engine and an FP8-capable GPU."""

from __future__ import annotations

import torch

from bebop_megatron.platform import have_transformer_engine

INSTALL_HINT = "install Transformer Engine with: pip install -e '.[gpu]'"


def check_fp8_available(device: str) -> None:
    """Raise ``ValueError`` with the reason when ``precision=fp8`` cannot run here."""
    if device != "cuda":
        raise ValueError(f"precision=fp8 needs a CUDA GPU with FP8 support (device is {device}); use precision=bf16 or fp32")
    if not have_transformer_engine():
        raise ValueError(f"precision=fp8 needs Transformer Engine, which is not importable; {INSTALL_HINT}")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ValueError(
            f"precision=fp8 needs an FP8-capable GPU (compute capability >= 8.9, e.g. H100/H200/L40S); "
            f"this GPU is {major}.{minor}"
        )
