"""Precision: FP8 needs Transformer Engine and a GPU that supports the chosen recipe; bf16 on a
CPU needs native bf16 instructions.

``precision=fp8`` runs the backbone forward and the MTP layers under Megatron-Core's FP8
autocast (``fp8_utils.get_fp8_context``, entered per transformer layer, which builds the TE
recipe from the ``TransformerConfig`` fields that ``model.builder.transformer_config`` sets from
``fp8.*``); the output layer and the loss stay in bf16 / float32.
"""

from __future__ import annotations

import os

import torch

from bebop_megatron.model.builder import fp8_transformer_settings  # noqa: F401  (re-exported)
from bebop_megatron.platform import have_transformer_engine

INSTALL_HINT = "install Transformer Engine with: pip install -e '.[gpu]'"

# Lowest compute capability per recipe: FP8 tensor cores arrive with Ada/Hopper (8.9 / 9.0);
# 1x128 / 128x128 block scales are a Hopper TE kernel; MX block-32 scaling is Blackwell only.
MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
# Transformer Engine release that introduced the recipe (Megatron-Core checks the same).
MIN_TE_VERSION = {"delayed": "1.0", "tensorwise": "2.2", "blockwise": "2.3", "mxfp8": "2.1"}


def check_fp8_available(device: str, recipe: str = "delayed") -> None:
    """Raise ``ValueError`` with the reason when ``precision=fp8`` with ``recipe`` cannot run here."""
    if device != "cuda":
        raise ValueError(
            f"precision=fp8 needs a CUDA GPU with FP8 support (device is {device}); use precision=bf16 or fp32"
        )
    if not have_transformer_engine():
        raise ValueError(f"precision=fp8 needs Transformer Engine, which is not importable; {INSTALL_HINT}")
    from megatron.core.utils import is_te_min_version

    if not is_te_min_version(MIN_TE_VERSION[recipe]):
        raise ValueError(
            f"fp8.recipe={recipe} needs Transformer Engine >= {MIN_TE_VERSION[recipe]}; {INSTALL_HINT}"
        )
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY[recipe]:
        need = ".".join(map(str, MIN_CAPABILITY[recipe]))
        raise ValueError(
            f"fp8.recipe={recipe} needs compute capability >= {need} "
            f"({'Blackwell, e.g. B200' if recipe == 'mxfp8' else 'e.g. H100/H200'}); this GPU "
            f"({torch.cuda.get_device_name()}) is {capability[0]}.{capability[1]}"
            + ("; use fp8.recipe=blockwise or tensorwise on Hopper" if recipe == "mxfp8" else "")
        )


# CPU flags (``/proc/cpuinfo``) of native bf16 arithmetic. Without one, torch's bf16 GEMMs with
# a long inner dimension run 30-500x slower than fp32 (measured on an AVX2-only CPU: 0.2-2 against
# 23-66 GFLOP/s; a 135M model's fused-loss gradient GEMM took 121 s against 1.1 s), so a bf16
# run there crawls silently.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
ALLOW_SLOW_BF16 = "BEBOP_ALLOW_SLOW_BF16"


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The first processor's flags, or None where the file is missing (not Linux x86)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool | None:
    """True/False from an x86 flag list; None where the flags say nothing (no file, not x86)."""
    flags = cpu_flags() if flags is None else flags
    if flags is None or not ({"avx2", "avx512f", "sse4_2"} & flags):
        return None
    return bool(set(BF16_CPU_FLAGS) & flags)


def check_cpu_bf16(device: str, precision: str, flags: set[str] | None = None) -> None:
    """Refuse ``precision=bf16`` on a CPU whose flags show no native bf16 (one line naming
    ``precision=fp32``); ``$BEBOP_ALLOW_SLOW_BF16=1`` runs it anyway. Unknown flags (no
    ``/proc/cpuinfo``, or an Arm CPU, whose flag names differ) are not refused."""
    if device != "cpu" or precision != "bf16" or os.environ.get(ALLOW_SLOW_BF16) == "1":
        return
    if cpu_has_native_bf16(flags) is False:
        raise ValueError(
            "precision=bf16 on this CPU: it has no native bf16 instructions (no avx512_bf16 or amx_bf16 in "
            "/proc/cpuinfo), where torch's bf16 matrix products run 30-500x slower than fp32; set precision=fp32 "
            f"(or {ALLOW_SLOW_BF16}=1 to run bf16 anyway)"
        )
