"""Precision: FP8 needs Transformer Engine and a GPU that supports the chosen recipe; bf16 on a
CPU needs bf16 matrix products measured to be about as fast as fp32's there.

``precision=fp8`` runs the backbone forward and the MTP layers under Megatron-Core's FP8
autocast (``fp8_utils.get_fp8_context``, entered per transformer layer, which builds the TE
recipe from the ``TransformerConfig`` fields that ``model.builder.transformer_config`` sets from
``fp8.*``); the output layer and the loss stay in bf16 / float32.
"""

from __future__ import annotations

import os
import time

import torch

from bebop_megatron.model.builder import fp8_transformer_settings  # noqa: F401  (re-exported)
from bebop_megatron.platform import cpu_model, have_transformer_engine  # noqa: F401  (cpu_model re-exported)
from bebop_megatron.platform.atomic import atomic_open

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


# bf16 on a CPU is allowed when it is measured to be fast enough here: torch's bf16 GEMMs run
# 30-500x slower than fp32 without native bf16 arithmetic (an AVX2-only CPU: 0.2-2 against 23-66
# GFLOP/s; a 135M model's fused-loss gradient GEMM took 121 s against 1.1 s), and the CPU flags
# did not tell enough (a 49k-vocabulary run on an EPYC with avx512_bf16 took 26 s in bf16, 10 s in
# fp32). So a one-time probe times the output layer's three GEMMs (forward, input and weight
# gradients; the last has the long inner dimension) in both precisions at this thread count, and
# caches the ratio per CPU model, thread count and torch version.
MAX_BF16_SLOWDOWN = 1.5
"""bf16 is refused on a CPU where the probe's GEMMs take more than this times fp32's time."""
ALLOW_SLOW_BF16 = "BEBOP_ALLOW_SLOW_BF16"
PROBE_FILE = "cpu_bf16_probe.json"
PROBE_SHAPE = (128, 256, 4096)  # (tokens S, hidden H, vocabulary V): ~0.8 GFLOP per precision
PROBE_VERSION = 1


def _gemm_seconds(dtype: torch.dtype, reps: int, give_up_after: float | None = None) -> float:
    """Best time of ``reps`` runs of the output layer's three GEMMs in ``dtype``; stops early
    once one run takes longer than ``give_up_after`` seconds (clearly too slow)."""
    S, H, V = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    hidden_SH = torch.randn(S, H, generator=generator).to(dtype)
    weight_VH = torch.randn(V, H, generator=generator).to(dtype)
    grad_SV = torch.randn(S, V, generator=generator).to(dtype)
    best = float("inf")
    with torch.no_grad():
        for _ in range(reps):
            start = time.perf_counter()
            hidden_SH @ weight_VH.t()
            grad_SV @ weight_VH
            grad_SV.t() @ hidden_SH
            best = min(best, time.perf_counter() - start)
            if give_up_after is not None and best > give_up_after:
                break
    return best


def probe_bf16_slowdown() -> float:
    """bf16 GEMM time over fp32's on this CPU (at this thread count)."""
    _gemm_seconds(torch.float32, 1)  # warm-up: thread pool, allocator
    fp32 = _gemm_seconds(torch.float32, 3)
    bf16 = _gemm_seconds(torch.bfloat16, 3, give_up_after=3 * MAX_BF16_SLOWDOWN * fp32)
    return bf16 / fp32


def measured_bf16_slowdown(probe=None) -> tuple[float, str]:
    """``(slowdown, cache file)``: the cached probe result for this CPU, thread count and torch
    version, measured (by the first of the ranks on this machine; the others wait) if missing."""
    import fcntl
    import json

    from bebop_megatron.training.synthetic_backbone import cache_root

    probe = probe or probe_bf16_slowdown

    path = os.path.join(cache_root(), PROBE_FILE)
    key = f"v{PROBE_VERSION} | {cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "a")
    except OSError:  # a cache that cannot be written: measure every time
        return probe(), "(not cached: the cache cannot be written)"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of one machine measure once and agree
        try:
            with open(path) as f:
                results = json.load(f)
            if not isinstance(results, dict):
                results = {}
        except (OSError, ValueError):
            results = {}
        if not isinstance(results.get(key), (int, float)):
            results[key] = probe()
            try:
                with atomic_open(path, "w") as f:
                    json.dump(results, f, indent=1)
            except OSError:
                pass
        return float(results[key]), path


def cpu_bf16_is_fast() -> bool:
    """Whether bf16 GEMMs on this CPU are measured within :data:`MAX_BF16_SLOWDOWN` of fp32's time."""
    return measured_bf16_slowdown()[0] <= MAX_BF16_SLOWDOWN


def check_cpu_bf16(device: str, precision: str, probe=None) -> None:
    """Refuse ``precision=bf16`` on a CPU where a bf16 GEMM is measured to take more than
    :data:`MAX_BF16_SLOWDOWN` times fp32's time (one line naming ``precision=fp32``);
    ``$BEBOP_ALLOW_SLOW_BF16=1`` runs it anyway. ``probe``: returns that ratio (measured once,
    cached: :func:`measured_bf16_slowdown`)."""
    if device != "cpu" or precision != "bf16" or os.environ.get(ALLOW_SLOW_BF16) == "1":
        return
    slowdown, cache = measured_bf16_slowdown(probe)
    if slowdown > MAX_BF16_SLOWDOWN:
        raise ValueError(
            f"precision=bf16 on this CPU: its bf16 matrix products take {slowdown:.1f}x the time of fp32 here "
            f"(measured once, cached in {cache}; more than {MAX_BF16_SLOWDOWN}x is refused); set precision=fp32 "
            f"(or {ALLOW_SLOW_BF16}=1 to run bf16 anyway)"
        )
