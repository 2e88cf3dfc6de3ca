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

import dataclasses

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from bebop_megatron.data.batches import document_starts
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
    rank, so not with sequence parallelism (the config refuses that combination)."""

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        if attention_mask is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        outputs = []
        for b, starts in enumerate(document_starts(attention_mask)):
            ends = starts[1:] + [hidden_states.shape[0]]
            outputs.append(torch.cat([super(PackedGatedDeltaNet, self).forward(
                hidden_states[s:e, b:b + 1], None, *args, **kwargs)[0] for s, e in zip(starts, ends)]))
        return torch.cat(outputs, dim=1), None


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
