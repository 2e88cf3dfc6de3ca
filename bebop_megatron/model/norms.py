"""A Megatron-compatible torch norm that supports sequence parallelism.

Megatron-Core's local spec uses ``WrappedTorchNorm``, which refuses
``sequence_parallel``. Under SP a norm sees only its sequence shard, so the gradient of
its weight is partial on each TP rank; Megatron sums such gradients across TP for every
parameter tagged ``sequence_parallel = True`` (``finalize_model_grads``). This norm sets
that tag, which is all SP needs. It also supports the zero-centred gamma
(``x * (1 + w)``) that Qwen3-Next/Qwen3.5 checkpoints use.
"""

from __future__ import annotations

import torch
from torch import nn


class SPAwareNorm(nn.Module):
    """RMSNorm or LayerNorm over the last dimension, usable under sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, for_qk: bool = False, **_):
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization {config.normalization!r} is not supported")
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        self.eps = eps
        init = 0.0 if self.zero_centered else 1.0
        self.weight = nn.Parameter(torch.full((hidden_size,), init, dtype=config.params_dtype))
        self.bias = None
        if not self.rms:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # qk norms act on gathered (full-sequence) activations: their gradients are
        # already complete on every TP rank and must not be summed again.
        sp = bool(config.sequence_parallel) and not for_qk
        for p in self.parameters():
            setattr(p, "sequence_parallel", sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1.0 if self.zero_centered else self.weight
        if self.rms:
            return nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return nn.functional.layer_norm(x, (x.shape[-1],), weight, self.bias, self.eps)


def qk_norm(config, hidden_size: int, eps: float = 1e-5, **kwargs) -> SPAwareNorm:
    """The norm for per-head query/key normalisation (never tagged sequence-parallel)."""
    return SPAwareNorm(config, hidden_size, eps, for_qk=True)


class LatentNorm(SPAwareNorm):
    """MLA's query and key-value latent norms (``q_layernorm`` / ``kv_layernorm``).

    Under SP they act on sequence shards: tagged ``sequence_parallel``, summed over TP. Without
    SP they act on the whole (duplicated) latent, whose gradient the column-parallel up
    projection has already summed over TP, so each rank's weight gradient is complete; but
    Megatron-Core's ``finalize_model_grads`` sums every parameter named ``q_layernorm`` over TP
    when ``qk_layernorm`` is set (meant for the per-head norms), which would count it TP times.
    Tagged ``average_gradients_across_tp_domain`` (checked first there), the TP ranks' equal
    gradients are averaged instead: unchanged."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(config, hidden_size, eps)
        if not config.sequence_parallel:
            for p in self.parameters():
                setattr(p, "average_gradients_across_tp_domain", True)


class HeadNorm(SPAwareNorm):
    """A norm over one head's features (Gated DeltaNet's gated output norm): never tagged
    sequence-parallel, like :func:`qk_norm`; a class because Megatron builds it from a spec."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(config, hidden_size, eps, for_qk=True)
