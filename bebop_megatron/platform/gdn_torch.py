"""Megatron-Core's Gated DeltaNet without flash-linear-attention (FLA): its own torch path.

Megatron-Core 0.19's ``GatedDeltaNet`` refuses to build when FLA is not importable, although
with ``deterministic_mode=True`` it runs only torch code (``torch_chunk_gated_delta_rule``
and ``F.conv1d``) apart from the query/key L2 normalisation, which it takes from FLA. Where
FLA is missing, :func:`enable` installs the two redirections below (the builder also sets
``deterministic_mode`` for models with Gated DeltaNet layers); where FLA is installed nothing
changes. ``check_megatron_compatibility()`` lists the attributes an upgrade removed.
"""

from __future__ import annotations

import importlib

import torch

from bebop_megatron.platform import lazy_imports

__all__ = ["REDIRECTIONS", "have_fla", "enable", "is_enabled", "check_megatron_compatibility", "l2norm"]

MODULE = "megatron.core.ssm.gated_delta_net.common"


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over ``dim``: the q/k normalisation of FLA and transformers."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


# (attribute of MODULE, replacement, reason)
REDIRECTIONS = (
    ("HAVE_FLA", True, "the module refuses to build without FLA, though the deterministic path needs none"),
    ("l2norm", l2norm, "q/k L2 normalisation comes from FLA (None without it); the same formula in torch"),
)
# Methods of _GDNBase that Megatron wraps in torch.compile (jit_fuser): run uncompiled.
UNCOMPILED = ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta")
UNCOMPILED_REASON = "torch.compile of these small element-wise functions costs seconds per process and a C++ compiler"
_enabled = False


def have_fla() -> bool:
    """Whether flash-linear-attention itself is importable (not our redirection)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or a broken Triton/CUDA install
        return False
    return True


def check_megatron_compatibility() -> list[str]:
    """The redirected attributes missing from the installed Megatron-Core (empty when all exist)."""
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return [f"{MODULE} (module missing)"]
    missing = [f"{MODULE}.{attr}" for attr, _, _ in REDIRECTIONS if not hasattr(module, attr)]
    base = getattr(module, "_GDNBase", None)
    return missing + [f"{MODULE}._GDNBase.{name}" for name in UNCOMPILED if base is None or not hasattr(base, name)]


def enable() -> bool:
    """Install the redirections where FLA is missing (idempotent); returns whether they are active."""
    global _enabled
    if _enabled or have_fla():
        return _enabled
    missing = check_megatron_compatibility()
    if missing:
        raise RuntimeError("cannot run Gated DeltaNet without FLA on this Megatron-Core version; missing: "
                           + ", ".join(missing))
    module = importlib.import_module(MODULE)
    for attr, value, _ in REDIRECTIONS:
        setattr(module, attr, value)
    for name in UNCOMPILED:
        fn = module._GDNBase.__dict__[name]
        setattr(module._GDNBase, name, lazy_imports.uncompiled(fn))
    _enabled = True
    return True


def is_enabled() -> bool:
    return _enabled
