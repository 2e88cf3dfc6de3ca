"""Core attention of the local layers: fused SDPA (default) or Megatron-Core's unfused reference.

``model.attention_backend`` picks the module that ``SelfAttention`` / ``MLASelfAttention`` call
with ``q [sq, b, heads, d_k]``, ``k``/``v`` ``[sk, b, groups, d_k | d_v]``:

- ``sdpa``: :class:`SDPAttention` runs ``torch.nn.functional.scaled_dot_product_attention``
  (flash / memory-efficient kernels on CUDA, the fused flash kernel on CPU): memory grows
  linearly with the sequence. Packed rows (:func:`~bebop_megatron.data.batches.attention_mask`:
  ``[B, S]`` document starts) run each document alone with ``is_causal=True``, which is exact
  and stays fused (no ``S x S`` mask). GQA via ``enable_gqa``.
- ``unfused``: :class:`UnfusedAttention` is Megatron-Core's ``DotProductAttention``
  (``baddbmm`` scores ``[b*heads, sq, sk]``, masked softmax, ``bmm``: ``S^2`` memory per head),
  expanding the document starts to its ``[B, 1, S, S]`` mask. The reference of the tests.

Multi-Latent Attention (DeepSeek-V3) has separate query/key and value head widths
(``k_channels`` / ``v_channels``). Transformer Engine's attention accepts them; Megatron-Core
0.19's local ``DotProductAttention`` does not (TypeError) and sizes its output as
``kv_channels * heads``. :class:`MLADotProductAttention` / :class:`MLASDPAttention` accept both
and size the output from the value heads, so MLA runs with the local modules (CPU and GPU).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from bebop_megatron.data.batches import dense_attention_mask, document_starts
from bebop_megatron.model.cp_attention import context_parallel_attention

ATTENTION_BACKENDS = ("sdpa", "unfused")


class _UnfusedForward:
    """Megatron's unfused forward, given the ``[B, 1, S, S]`` mask of packed rows' document starts."""

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = dense_attention_mask(attention_mask)
        return super().forward(query, key, value, attention_mask, *args, **kwargs)


@contextlib.contextmanager
def _local_cp_attention(config):
    """``DotProductAttention`` asserts context_parallel_size == 1 (only TE's attention has CP);
    the SDPA modules compute CP attention themselves, so they are built as for C = 1."""
    cp = config.context_parallel_size
    config.context_parallel_size = 1
    try:
        yield
    finally:
        config.context_parallel_size = cp


class _SDPAForward:
    """``DotProductAttention``'s interface and settings, computed by fused SDPA kernels."""

    def _check_sdpa(self, config, layer_number: int) -> None:
        if config.softmax_type != "vanilla":
            raise ValueError(f"model.attention_backend=sdpa has no softmax_type={config.softmax_type!r} "
                             "(softmax offsets); use model.attention_backend=unfused")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("model.attention_backend=sdpa has no window attention; "
                             "use model.attention_backend=unfused")

    def _sdpa_scale(self) -> float:
        # DotProductAttention divides the scale by the layer number under
        # apply_query_key_layer_scaling and multiplies the scores back in its softmax.
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        return self.softmax_scale * coeff

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes no packed_seq_params or attention_bias (packed rows come as "
                             "attention_mask document starts)")
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        # attn_mask_type is not used, as in DotProductAttention (its softmax reads the module's).
        causal = self.attn_mask_type == AttnMaskType.causal and sq > 1
        if causal and sq != sk:
            raise ValueError(f"causal SDPAttention needs as many queries as keys (got {sq} and {sk})")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if self.config.context_parallel_size > 1:  # this rank's chunks against the whole row
            return self._attend_cp(q, k, v, attention_mask, causal, sq, b)
        kwargs = dict(scale=self._sdpa_scale(), enable_gqa=q.shape[1] != k.shape[1],
                      dropout_p=self.attention_dropout.p if self.training else 0.0)
        if kwargs["dropout_p"] and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend(q, k, v, attention_mask, causal, kwargs)
        else:
            out = self._attend(q, k, v, attention_mask, causal, kwargs)
        # [b, heads, sq, d_v] -> [sq, b, heads * d_v]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _attend_cp(self, q, k, v, attention_mask, causal: bool, sq: int, b: int) -> torch.Tensor:
        if not causal or (attention_mask is not None and attention_mask.dim() != 2):
            raise ValueError("parallel.context > 1 supports causal attention (with packed rows' document starts) only")
        starts = None if attention_mask is None else document_starts(attention_mask)
        out = context_parallel_attention(q, k, v, starts, scale=self._sdpa_scale(),
                                         cp_group=parallel_state.get_context_parallel_group())
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    @staticmethod
    def _attend(q, k, v, attention_mask, causal: bool, kwargs: dict) -> torch.Tensor:
        if attention_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
        if attention_mask.dim() == 4:  # a caller's own [B or 1, 1, sq, sk] mask (True = masked): S^2
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, **kwargs)
        # Document starts of packed rows: causal attention within each document, as in the
        # [B, 1, S, S] mask they expand to; each document runs alone through the fused kernel.
        rows = []
        for r, starts in enumerate(document_starts(attention_mask)):
            ends = starts[1:] + [q.shape[2]]
            rows.append(torch.cat([F.scaled_dot_product_attention(
                q[r:r + 1, :, s:e], k[r:r + 1, :, s:e], v[r:r + 1, :, s:e], is_causal=True, **kwargs)
                for s, e in zip(starts, ends)], dim=2))
        return torch.cat(rows, dim=0)


class UnfusedAttention(_UnfusedForward, DotProductAttention):
    """Megatron-Core's ``DotProductAttention`` (``model.attention_backend=unfused``)."""


class SDPAttention(_SDPAForward, DotProductAttention):
    """``DotProductAttention``'s constructor, settings and checkpoint keys (none), with SDPA
    kernels (``model.attention_backend=sdpa``); no softmax offsets or window attention. Under
    context parallelism (``parallel.context > 1``) it runs
    :func:`~bebop_megatron.model.cp_attention.context_parallel_attention`."""

    def __init__(self, config, layer_number: int, *args, **kwargs):
        self._check_sdpa(config, layer_number)
        with _local_cp_attention(config):
            super().__init__(config, layer_number, *args, **kwargs)


class _MLAWidths(DotProductAttention):
    """``DotProductAttention`` with separate query/key and value head widths.

    The attention math is shape-agnostic (``Q K^T`` over the key width, then ``P V``); only
    the output view ``[sq, b, heads_per_partition * v_channels]`` and the default softmax
    scale ``1/sqrt(k_channels)`` depend on the widths. MLA passes its own softmax scale.
    Keys and values come with one head per query head (``num_query_groups`` must equal
    ``num_attention_heads``, as :func:`~bebop_megatron.model.builder.transformer_config` sets).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError(f"{type(self).__name__} needs num_query_groups == num_attention_heads "
                             f"(got {config.num_query_groups} and {config.num_attention_heads})")
        if softmax_scale is None and k_channels is not None:
            softmax_scale = k_channels ** -0.5
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            world_size = self.pg_collection.tp.size()
            self.hidden_size_per_attention_head_v = v_channels
            # forward() views its output as [sq, b, hidden_size_per_partition]
            self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, world_size)


class MLADotProductAttention(_UnfusedForward, _MLAWidths):
    """The unfused MLA core attention (``model.attention_backend=unfused``)."""


class MLASDPAttention(_SDPAForward, _MLAWidths):
    """The SDPA MLA core attention (``model.attention_backend=sdpa``), with context parallelism
    as :class:`SDPAttention`."""

    def __init__(self, config, layer_number: int, *args, **kwargs):
        self._check_sdpa(config, layer_number)
        with _local_cp_attention(config):
            super().__init__(config, layer_number, *args, **kwargs)


def core_attention(backend: str, mla: bool = False) -> type:
    """The core attention class of ``model.attention_backend`` (GQA or MLA)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend={backend!r} must be one of {', '.join(ATTENTION_BACKENDS)}")
    if mla:
        return MLASDPAttention if backend == "sdpa" else MLADotProductAttention
    return SDPAttention if backend == "sdpa" else UnfusedAttention
