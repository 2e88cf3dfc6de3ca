"""Megatron-Core's local core attention, extended for Multi-Latent Attention (DeepSeek-V3).

``MLASelfAttention`` builds its core attention with ``k_channels`` (query/key head width,
``qk_head_dim + qk_pos_emb_head_dim``) and ``v_channels`` (value head width,
``v_head_dim``). Transformer Engine's attention accepts them; Megatron-Core 0.19's local
``DotProductAttention`` does not (TypeError), and sizes its output as
``kv_channels * heads``. This subclass accepts both and sizes the output from the value
heads, so MLA runs with Megatron-Core's local modules (CPU and GPU).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import divide


class MLADotProductAttention(DotProductAttention):
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
            raise ValueError("MLADotProductAttention needs num_query_groups == num_attention_heads "
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
