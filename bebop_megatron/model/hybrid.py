"""Qwen3-Next / Qwen3.5 layers: Gated DeltaNet and gated full attention, as ``TransformerLayer``s.

One Hugging Face decoder layer is one Megatron ``TransformerLayer``: input norm, token mixer,
residual, pre-MLP norm, MLP (dense or MoE), residual. The mixer follows
``model.layer_types``: ``linear_attention`` is Megatron-Core's ``GatedDeltaNet`` (the module
of its experimental attention-variant specs, whose providers assume Transformer Engine; these
specs use the local backend), ``full_attention`` is ``SelfAttention`` with
``attention_output_gate`` (the query projection also produces a sigmoid output gate). So the
model stays a ``GPTModel``: the MTP block, pipeline stages, checkpoints and freezing work as
for the other families, and the MTP layer is the full-attention layer (both engines run it).

Checkpoint keys equal those of Megatron's Transformer Engine specs (``keys_map``): TE fuses the
input norm into ``in_proj`` / ``linear_qkv`` and a dense pre-MLP norm into ``linear_fc1``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from bebop_megatron.data.batches import document_starts
from bebop_megatron.model.cp_attention import gather_sequence, shard_sequence
from bebop_megatron.model.norms import HeadNorm, SPAwareNorm
from bebop_megatron.model.specs import LocalSPSpecProvider, local_layer_spec

LAYER_TYPES = ("full_attention", "linear_attention")


class PackedGatedDeltaNet(GatedDeltaNet):
    """Megatron's ``GatedDeltaNet`` that restarts its state at every document of a packed row.

    The torch path takes no ``cu_seqlens``: run on a packed row, the convolution and the
    recurrent state would carry one document into the next. Given the per-document attention
    mask of packed rows (``[B, S]`` document starts, or a ``[B, 1, S, S]`` mask; ``data/batches.py``),
    each document of each row runs alone, exactly as it would in a row of its own; without a mask
    (no row holds two documents) the whole batch runs at once. The documents' starts are read once
    per mask (one host sync per micro-batch, shared by all layers). Needs the whole sequence on each
    rank, so not with sequence parallelism (the config refuses that combination).

    Context parallelism (``parallel.context = C > 1``): the recurrent state and the short
    convolution run along the whole row, so the layer's input chunks are all-gathered over the CP
    group (``cp_attention.gather_sequence``: its backward sums the ranks' gradients and keeps this
    rank's chunks), every CP rank runs the layer on the whole rows (per document, as above) and
    keeps its own chunks of the output. Exact; it costs each CP rank the layer's compute and
    activations of the whole rows (linear in S). Megatron's own head-parallel CP path is not used
    (the module is built as for C = 1: a one-rank stand-in CP group), as its torch path has no
    per-document restart."""

    def __init__(self, config, submodules, layer_number=None, *args, pg_collection=None, **kwargs):
        cp_group = None
        if pg_collection is not None and pg_collection.cp.size() > 1:
            cp_group, pg_collection = pg_collection.cp, copy.copy(pg_collection)
            pg_collection.cp = _OneRankGroup()
        super().__init__(config, submodules, layer_number, *args, pg_collection=pg_collection, **kwargs)
        self.cp_group = cp_group

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        if self.cp_group is None:
            return self._forward_rows(hidden_states, attention_mask, *args, **kwargs)
        group = self.cp_group
        whole = gather_sequence(hidden_states.transpose(0, 1), group).transpose(0, 1)  # [S, b, h]
        out, bias = self._forward_rows(whole, attention_mask, *args, **kwargs)
        rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        return shard_sequence(out, rank, size, dim=0), bias

    def _forward_rows(self, hidden_states, attention_mask, *args, **kwargs):
        if attention_mask is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        outputs = []
        for b, starts in enumerate(document_starts(attention_mask)):
            ends = starts[1:] + [hidden_states.shape[0]]
            outputs.append(torch.cat([super(PackedGatedDeltaNet, self).forward(
                hidden_states[s:e, b:b + 1], None, *args, **kwargs)[0] for s, e in zip(starts, ends)]))
        return torch.cat(outputs, dim=1), None


class _OneRankGroup:
    """The CP group ``GatedDeltaNet`` is built with under context parallelism: one rank, so its
    CP all-to-alls and per-rank parameter slices are identities (PackedGatedDeltaNet gathers whole rows)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def gated_delta_net_spec() -> ModuleSpec:
    """Gated DeltaNet (restarting at packed documents) with local modules: column-parallel ``in_proj`` (rows ``[q|k|v|z|beta|alpha]``),
    the gated output norm over each value head (never sequence-parallel: it sees whole heads),
    row-parallel ``out_proj``."""
    backend = LocalSPSpecProvider()
    return ModuleSpec(module=PackedGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=backend.column_parallel_linear(), out_norm=HeadNorm, out_proj=backend.row_parallel_linear()))


def layer_spec(layer_type: str, num_experts: int | None, attention_backend: str = "sdpa") -> ModuleSpec:
    """The local ``TransformerLayer`` of one layer type (gated attention comes from the config)."""
    attention = local_layer_spec(num_experts, qk_layernorm=True, attention_backend=attention_backend)
    if layer_type == "full_attention":
        return attention
    sub = attention.submodules
    keys_map = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    if not num_experts:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(module=attention.module, submodules=dataclasses.replace(
        sub, self_attention=gated_delta_net_spec(), sharded_state_dict_keys_map=keys_map))


def decoder_block_spec(config, layer_types: list[str], num_experts: int | None,
                       attention_backend: str = "sdpa") -> TransformerBlockSubmodules:
    """This pipeline stage's layers, each from its ``layer_types`` entry; SP-aware final norm."""
    offset = get_transformer_layer_offset(config)
    layers = [layer_spec(layer_types[offset + i], num_experts, attention_backend)
              for i in range(get_num_layers_to_build(config))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SPAwareNorm)


def mtp_layer_spec(num_experts: int | None, attention_backend: str = "sdpa") -> ModuleSpec:
    """The MTP block's decoder layer: a full (gated) attention layer with the family's MLP."""
    return layer_spec("full_attention", num_experts, attention_backend)
