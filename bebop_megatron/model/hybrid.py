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

from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from bebop_megatron.model.norms import HeadNorm, SPAwareNorm
from bebop_megatron.model.specs import LocalSPSpecProvider, local_layer_spec

LAYER_TYPES = ("full_attention", "linear_attention")


def gated_delta_net_spec() -> ModuleSpec:
    """Gated DeltaNet with local modules: column-parallel ``in_proj`` (rows ``[q|k|v|z|beta|alpha]``),
    the gated output norm over each value head (never sequence-parallel: it sees whole heads),
    row-parallel ``out_proj``."""
    backend = LocalSPSpecProvider()
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=backend.column_parallel_linear(), out_norm=HeadNorm, out_proj=backend.row_parallel_linear()))


def layer_spec(layer_type: str, num_experts: int | None) -> ModuleSpec:
    """The local ``TransformerLayer`` of one layer type (gated attention comes from the config)."""
    attention = local_layer_spec(num_experts, qk_layernorm=True)
    if layer_type == "full_attention":
        return attention
    sub = attention.submodules
    keys_map = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    if not num_experts:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(module=attention.module, submodules=dataclasses.replace(
        sub, self_attention=gated_delta_net_spec(), sharded_state_dict_keys_map=keys_map))


def decoder_block_spec(config, layer_types: list[str], num_experts: int | None) -> TransformerBlockSubmodules:
    """This pipeline stage's layers, each from its ``layer_types`` entry; SP-aware final norm."""
    offset = get_transformer_layer_offset(config)
    layers = [layer_spec(layer_types[offset + i], num_experts) for i in range(get_num_layers_to_build(config))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SPAwareNorm)


def mtp_layer_spec(num_experts: int | None) -> ModuleSpec:
    """The MTP block's decoder layer: a full (gated) attention layer with the family's MLP."""
    return layer_spec("full_attention", num_experts)
