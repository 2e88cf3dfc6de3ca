"""Layer specs per model family, built from Megatron-Core's spec providers.

Two families: ``dense`` (GQA attention, SwiGLU MLP, RMSNorm, optional qk-norm and qkv
bias: Llama / Qwen2 / Qwen3 / MiMo shapes) and ``moe`` (the same attention with routed and
shared experts: Qwen3-MoE / GLM-4.5 shapes). Either attention can be Multi-Latent
Attention instead (``model.multi_latent_attention``: DeepSeek-V3 shapes). The MTP layer
reuses the family's layer spec (``get_gpt_mtp_block_spec``), so an MoE model gets
expert-parallel MoE MTP layers.

Backends: ``local`` (Megatron-Core modules only, with an SP-aware torch norm; CPU and GPU)
and ``transformer_engine`` (Megatron-Core's TE spec; needed for FP8). The local layers' core
attention follows ``model.attention_backend`` (``sdpa`` or ``unfused``; ``model/attention.py``).
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec_for_backend,
    get_mlp_module_spec_for_backend,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from bebop_megatron.model.attention import core_attention
from bebop_megatron.model.mla import TPExactMLASelfAttention
from bebop_megatron.model.norms import LatentNorm, SPAwareNorm, qk_norm


class LocalSPSpecProvider(LocalSpecProvider):
    """Megatron's local backend with a norm that supports sequence parallelism."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return qk_norm if for_qk else SPAwareNorm


def local_layer_spec(num_experts: int | None, qk_layernorm: bool, attention_backend: str = "sdpa") -> ModuleSpec:
    """The decoder layer of both families with Megatron-Core's local modules."""
    backend = LocalSPSpecProvider()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=backend.layer_norm(),
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=core_attention(attention_backend),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=backend.layer_norm(for_qk=True) if qk_layernorm else IdentityOp,
                    k_layernorm=backend.layer_norm(for_qk=True) if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=backend.layer_norm(),
            mlp=get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts),
            mlp_bda=get_bias_dropout_add,
            # Same checkpoint keys as the TE spec, so checkpoints move between backends: TE
            # fuses the input norm into linear_qkv and a dense layer's pre-MLP norm into
            # linear_fc1; an MoE layer keeps its own pre_mlp_layernorm.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                **({} if num_experts else {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}),
            },
        ),
    )


def local_mla_layer_spec(num_experts: int | None, qk_layernorm: bool, attention_backend: str = "sdpa") -> ModuleSpec:
    """The MLA decoder layer (DeepSeek-V3) with Megatron-Core's local modules.

    Megatron's own local MLA spec, with four swaps: the attention module sums the rope key's
    gradient over TP (``model/mla.py``), the core attention accepts MLA's separate key and
    value head widths (``model/attention.py``, either backend), the layer norms are the
    SP-aware norm and the query/key-value latent norms its :class:`LatentNorm` (under SP they
    act on sequence-parallel shards and are tagged like the layer norms; without SP their
    gradients are complete on every TP rank and must not be summed over TP again).
    """
    sub = get_gpt_layer_local_submodules(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                         multi_latent_attention=True, normalization="RMSNorm")
    attn = sub.self_attention
    attn_sub = dataclasses.replace(
        attn.submodules,
        core_attention=core_attention(attention_backend, mla=True),
        q_layernorm=LatentNorm if qk_layernorm else IdentityOp,
        kv_layernorm=LatentNorm if qk_layernorm else IdentityOp,
    )
    # Same checkpoint keys as the Transformer Engine MLA spec (latent norms fused into the
    # up projections; a dense layer's pre-MLP norm fused into linear_fc1).
    keys_map = {
        "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
        "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
    }
    if num_experts is None:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=dataclasses.replace(
            sub,
            input_layernorm=SPAwareNorm,
            pre_mlp_layernorm=SPAwareNorm,
            self_attention=ModuleSpec(module=TPExactMLASelfAttention, params=attn.params, submodules=attn_sub),
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def layer_spec(num_experts: int | None, qk_layernorm: bool, use_te: bool,
               multi_latent_attention: bool = False, attention_backend: str = "sdpa") -> ModuleSpec:
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
        )
    if multi_latent_attention:
        return local_mla_layer_spec(num_experts, qk_layernorm, attention_backend)
    return local_layer_spec(num_experts, qk_layernorm, attention_backend)


def decoder_block_spec(config, decoder_layer_spec: ModuleSpec, use_te: bool,
                       dense_layer_spec: ModuleSpec | None = None, num_dense_layers: int = 0):
    """The decoder block of this pipeline rank; the local backend's final norm is SP-aware.

    With ``num_dense_layers`` (MoE models whose first layers are dense, GLM-4.5/DeepSeek-V3)
    the first layers of the whole model use ``dense_layer_spec``.
    """
    if use_te and not num_dense_layers:
        return decoder_layer_spec  # Megatron picks TE's norm for the final layernorm
    num_layers = get_num_layers_to_build(config)
    offset = get_transformer_layer_offset(config)
    layer_specs = [dense_layer_spec if offset + i < num_dense_layers else decoder_layer_spec
                   for i in range(num_layers)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=SPAwareNorm)


def mtp_block_spec(config, decoder_layer_spec: ModuleSpec, use_te: bool):
    """The MTP block spec for this pipeline rank (None where it holds no MTP layer)."""
    if use_te:
        from megatron.core.models.backends import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSPSpecProvider()
    return get_gpt_mtp_block_spec_for_backend(config=config, spec=decoder_layer_spec, backend=backend)
