"""Multi-Latent Attention of the local layers, with the rope key's gradient summed over TP.

Megatron-Core 0.19's local MLA spec builds the latent down projections as
``ColumnParallelLinear``: each TP rank computes a slice of the ``kv_lora_rank +
qk_pos_emb_head_dim`` outputs and ``MLASelfAttention`` gathers them (the backward of that
gather keeps this rank's slice of the gradient). The latent ``kv`` part then reaches the
column-parallel up projection, whose input gradient is summed over TP, so its gradient is
complete. The decoupled rope key ``k_pos_emb`` (one head shared by all heads) is used only
by this rank's heads and nothing sums its gradient over TP: the rank holding those columns of
the down projection keeps its own heads' share only, so the rope-key rows of
``linear_kv_down_proj``'s gradient (and the input gradient through them) miss the other ranks'
heads (with TP=2 about half of it), with or without sequence parallelism.

:class:`TPExactMLASelfAttention` returns the gathered, full-width latent instead, so Megatron
takes its other path (the one of Transformer Engine's duplicated down projection): under SP the
latent is scattered back to the sequence shards and Megatron gathers the rope key from them,
whose backward sums the shards' gradients over TP (all heads); without SP the rope key passes
through ``copy_to_tensor_model_parallel_region`` (identity, gradient all-reduced over TP).
The weights stay ``ColumnParallelLinear`` slices: checkpoints and the forward are unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class TPExactMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose rope key gets the gradient of every TP rank's heads."""

    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        rank, rope = self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == rank + rope:  # not sharded (TP=1): Megatron's path is exact
            return q_compressed, kv_combined
        # [s, b, (rank + rope) / TP] -> [s, b, rank + rope]: the whole sequence (gathered under SP)
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if self.config.sequence_parallel:
            # [s / TP, b, rank + rope]; Megatron gathers k_pos_emb from the sequence shards, and
            # that gather's backward reduce-scatters its gradient: summed over the ranks' heads.
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [rank, rope], dim=-1)
        k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb, group=self.tp_group)
        return q_compressed, torch.cat([kv_compressed, k_pos_emb], dim=-1)
