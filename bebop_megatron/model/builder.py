"""Build the Megatron ``GPTModel`` with an MTP block and freeze its backbone.

Legend: S sequence, B micro-batch, H hidden, K MTP steps.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.utils import make_viewless_tensor

from bebop_megatron.config import Config
from bebop_megatron.config.hybrid import has_linear_attention
from bebop_megatron.model import hybrid, specs
from bebop_megatron.platform import gdn_torch


class PreNormChainMTPLayer(MultiTokenPredictionLayer):
    """An MTP layer that returns its output before its final norm (``mtp.next_step_input=pre_norm``).

    Megatron-Core's layer applies ``final_layernorm`` before returning, so the next step's
    ``hnorm`` sees a normed, per-channel scaled state; vLLM's DeepSeek-V3 / GLM-4.5 drafts pass
    the un-normed one. :class:`MTPGPTModel` applies each step's ``final_layernorm`` to that
    step's output afterwards, for the logits."""

    def _postprocess(self, hidden_states: torch.Tensor):
        return make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)


class MTPGPTModel(GPTModel):
    """``GPTModel`` whose last stage returns the hidden states of the backbone and every MTP step.

    Megatron's ``_postprocess`` runs the MTP block and then its own CE loss. Here the MTP
    block runs as usual and the concatenated hidden states ``[(1+K)*S, B, H]`` (backbone
    final hidden state first, after the final norm) are returned, so the trainer's loss
    (CE now, the TV family later) is computed outside the model with ``output_layer``.
    Stages without the post-process return their hidden states unchanged.
    """

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                     rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, attention_mask=None,
                     packed_seq_params=None, sequence_len_offset=None, padding_mask=None,
                     extra_block_kwargs=None, **_unused):
        if mtp_in_postprocess:
            hidden_states = self.mtp(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                inference_params=None,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                padding_mask=padding_mask,
                embedding=self.embedding,
                **(extra_block_kwargs or {}),
            )
            if isinstance(self.mtp.layers[0], PreNormChainMTPLayer):
                hidden_states = self._norm_mtp_outputs(hidden_states)
        return hidden_states

    def _norm_mtp_outputs(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Apply each MTP step's ``final_layernorm`` to its chunk of ``[(1+K)*S, B, H]`` (the
        backbone chunk is already normed)."""
        chunks = list(torch.chunk(hidden_states, 1 + self.config.mtp_num_layers, dim=0))
        for k in range(1, len(chunks)):
            layer = self.mtp.layers[0 if self.mtp.mtp_use_repeated_layer else k - 1]
            chunks[k] = layer.final_layernorm(chunks[k])
        return torch.cat(chunks, dim=0)

    def output_weight(self) -> torch.Tensor | None:
        """The weight to pass to ``output_layer`` (the embedding when tied)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return None


def output_weight_of(model) -> torch.Tensor:
    """The (frozen) output projection ``[V_local, H]`` every MTP step's draft logits share: the
    embedding when tied."""
    weight = model.output_weight()
    return weight if weight is not None else model.output_layer.weight


def use_transformer_engine(cfg: Config, device: str) -> bool:
    from bebop_megatron.platform import have_transformer_engine

    impl = cfg.model.transformer_impl
    if impl == "local" or has_linear_attention(cfg.model) or cfg.parallel.context > 1:  # local specs only
        return False
    te = have_transformer_engine() and device == "cuda"
    if impl == "transformer_engine" and not te:
        raise ValueError(
            "model.transformer_impl=transformer_engine needs Transformer Engine on a CUDA device "
            "(install with: pip install -e '.[gpu]')"
        )
    return te


def padded_vocab_size(cfg: Config) -> int:
    """Vocabulary padded so that every TP rank holds an equal, aligned shard."""
    if cfg.model.padded_vocab_size:
        return cfg.model.padded_vocab_size
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor
    return -(-cfg.model.vocab_size // multiple) * multiple


def fp8_transformer_settings(cfg) -> dict:
    """The ``TransformerConfig`` fields for ``cfg.fp8`` (empty unless ``precision=fp8``)."""
    if cfg.precision != "fp8":
        return {}
    f = cfg.fp8
    return {
        "fp8": f.format,
        "fp8_recipe": f.recipe,
        "fp8_amax_history_len": f.amax_history_len,
        "fp8_amax_compute_algo": f.amax_compute_algo,
    }


def transformer_config(cfg: Config, device: str, use_te: bool) -> TransformerConfig:
    m, p = cfg.model, cfg.parallel
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}[cfg.precision]
    moe = m.family == "moe"
    hybrid = has_linear_attention(m)
    torch_gdn = hybrid and gdn_torch.enable()
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        expert_model_parallel_size=p.expert,
        expert_tensor_parallel_size=p.expert_tensor if p.expert_tensor is not None else p.tensor,
        context_parallel_size=p.context,
        sequence_parallel=p.sequence_parallel,
        pipeline_model_parallel_layout=p.pipeline_layout,
        mtp_num_layers=cfg.mtp.num_steps,
        mtp_use_repeated_layer=cfg.mtp.num_layers == 1 and cfg.mtp.num_steps > 1,
        mtp_detach_heads=cfg.mtp.detach_heads,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # precision=fp8: format and recipe for Megatron-Core's per-layer FP8 autocast.
        **fp8_transformer_settings(cfg),
        # Weights are built on the CPU as full tensors and sliced per rank: on CPU there is
        # nothing else, and on GPU this makes initialisation independent of the layout.
        use_cpu_initialization=True,
        calculate_per_token_loss=True,
        # Gated DeltaNet without FLA: only the deterministic path is torch code (platform/gdn_torch.py).
        deterministic_mode=(cfg.train.deterministic and device == "cpu") or torch_gdn,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        transformer_impl="transformer_engine" if use_te else "local",
    )
    if moe:
        kwargs.update(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            moe_token_dispatcher_type=m.moe_token_dispatcher_type,
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
            moe_grouped_gemm=use_te,
            moe_router_dtype="fp32",
            moe_router_pre_softmax=m.moe_router_pre_softmax,
            moe_router_score_function=m.moe_router_score_function,
            moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
            moe_router_num_groups=m.moe_router_num_groups,
            moe_router_group_topk=m.moe_router_group_topk,
            moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
            # A list makes Megatron key every layer separately in checkpoints (mixed dense/MoE).
            moe_layer_freq=([0] * m.moe_first_dense_layers + [1] * (m.num_layers - m.moe_first_dense_layers)
                            if m.moe_first_dense_layers else 1),
        )
    kwargs.update(qwen_hybrid_settings(m, hybrid))
    if m.multi_latent_attention:
        kwargs.update(mla_transformer_settings(m))
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def qwen_hybrid_settings(m, hybrid: bool) -> dict:
    """Qwen3-Next / Qwen3.5 fields: zero-centred norms, gated attention, shared-expert gate and
    the Gated DeltaNet layers (``linear_attention_freq`` as a list keys every layer separately)."""
    out = dict(layernorm_zero_centered_gamma=m.zero_centered_norms, attention_output_gate=m.attention_output_gate)
    if m.family == "moe":
        out["moe_shared_expert_gate"] = m.moe_shared_expert_gate
    if hybrid:
        out.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=[int(t == "linear_attention") for t in m.layer_types],
            linear_conv_kernel_dim=m.linear_conv_kernel_dim,
            linear_key_head_dim=m.linear_key_head_dim,
            linear_value_head_dim=m.linear_value_head_dim,
            linear_num_key_heads=m.linear_num_key_heads,
            linear_num_value_heads=m.linear_num_value_heads,
        )
    return out


def mla_transformer_settings(m) -> dict:
    """The ``MLATransformerConfig`` fields of a Multi-Latent Attention model (DeepSeek-V3)."""
    out = dict(
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        # DotProductAttention's output width is per value head (see model/attention.py).
        kv_channels=m.v_head_dim,
        num_query_groups=m.num_attention_heads,
        rope_type=m.rope_type,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        # Megatron's MLA scales the softmax by m(factor, mscale_all_dim)**2 for both RoPE types:
        # neutral values unless YaRN is on.
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
    )
    if m.rope_type == "yarn":
        out.update(
            rotary_scaling_factor=m.yarn_scaling_factor,
            original_max_position_embeddings=m.yarn_original_max_position_embeddings,
            beta_fast=m.yarn_beta_fast,
            beta_slow=m.yarn_beta_slow,
            mscale=m.yarn_mscale,
            mscale_all_dim=m.yarn_mscale_all_dim,
        )
    return out


def build_model(cfg: Config, device: str, pg_collection=None) -> MTPGPTModel:
    """Build this rank's model chunk with the backbone frozen (see :func:`freeze_backbone`)."""
    use_te = use_transformer_engine(cfg, device)
    tconfig = transformer_config(cfg, device, use_te)
    num_experts = cfg.model.num_experts if cfg.model.family == "moe" else None
    mla, attn = cfg.model.multi_latent_attention, cfg.model.attention_backend
    if has_linear_attention(cfg.model):
        layer = hybrid.mtp_layer_spec(num_experts, attn)
        block = hybrid.decoder_block_spec(tconfig, list(cfg.model.layer_types), num_experts, attn)
    else:
        layer = specs.layer_spec(num_experts, cfg.model.qk_layernorm, use_te, mla, attn)
        block = None
    mtp_spec = specs.mtp_block_spec(tconfig, layer, use_te)
    if mtp_spec is not None and cfg.mtp.next_step_input == "pre_norm":
        mtp_spec = dataclasses.replace(mtp_spec, layer_specs=[
            dataclasses.replace(spec, module=PreNormChainMTPLayer) for spec in mtp_spec.layer_specs])
    num_dense = cfg.model.moe_first_dense_layers if num_experts else 0
    dense = specs.layer_spec(None, cfg.model.qk_layernorm, use_te, mla, attn) if num_dense else None
    model = MTPGPTModel(
        config=tconfig,
        transformer_layer_spec=block or specs.decoder_block_spec(tconfig, layer, use_te, dense, num_dense),
        vocab_size=padded_vocab_size(cfg),
        max_sequence_length=cfg.model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        share_embeddings_and_output_weights=cfg.model.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=cfg.model.rotary_percent,
        rotary_base=int(cfg.model.rotary_base) if float(cfg.model.rotary_base).is_integer() else cfg.model.rotary_base,
        mtp_block_spec=mtp_spec,
        pg_collection=pg_collection,
    )
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    if cfg.model.freeze_backbone:
        freeze_backbone(model)
    return model


def is_mtp_param(name: str) -> bool:
    return name.startswith("mtp.") or ".mtp." in name


def freeze_backbone(model: torch.nn.Module) -> None:
    """Embedding, decoder, final norm and output layer: ``requires_grad=False``.

    With no backbone parameter requiring grad and inputs that do not require grad, autograd
    records nothing for the backbone: no graph, no stored activations. Gradients still flow
    from the loss through the frozen output layer into the MTP layers.
    """
    for name, param in model.named_parameters():
        param.requires_grad_(is_mtp_param(name))


def mtp_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
