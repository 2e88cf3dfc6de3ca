"""Supported Hugging Face architectures and the bebop ``ModelConfig`` fields they map to."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

from bebop_megatron.convert import qwen_config
from bebop_megatron.convert.errors import ConvertError

# HF ``architectures[0]`` -> family name used by the key maps.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MiMoForCausalLM": "mimo",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    **qwen_config.ARCHITECTURES,
}
# Named in the issue but not implemented yet: refused with this reason.
NOT_YET: dict[str, str] = {}
# Families with DeepSeek/GLM-style MoE: sigmoid router with e_score_correction_bias, group-limited
# routing, routed_scaling_factor, shared experts, leading dense layers, NextN MTP layers.
NEXTN_MOE = ("glm4_moe", "deepseek_v3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LayerShape:
    """What a decoder layer's key map needs to know."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0  # 0: dense MLP
    moe_ffn_hidden_size: int = 0
    shared_ffn_hidden_size: int = 0  # shared expert(s) width; 0: none
    expert_bias: bool = False  # router's e_score_correction_bias (GLM / DeepSeek)
    # Multi-Latent Attention (DeepSeek-V3); kv_lora_rank 0: GQA attention
    q_lora_rank: int | None = None  # None: queries projected directly (q_proj)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Qwen3-Next / Qwen3.5 (see convert/qwen_hybrid.py)
    output_gate: bool = False  # gated attention: q_proj also produces the output gate
    shared_expert_gate: bool = False  # Qwen names: mlp.shared_expert.* and mlp.shared_expert_gate
    linear: bool = False  # this layer's mixer is a Gated DeltaNet (linear_attn.*)
    gdn_grouped: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba (else Qwen3.5's four projections)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0


@dataclass
class HFModel:
    """A parsed ``config.json``."""

    family: str
    config: dict
    layer: LayerShape
    num_layers: int
    vocab_size: int
    num_mtp_layers: int
    tie_embeddings: bool
    dtype: torch.dtype
    first_dense_layers: int = 0  # leading layers with a dense MLP in an MoE model
    layer_types: list | None = None  # Qwen3-Next / Qwen3.5: per layer full_attention | linear_attention
    prefix: str = "model."  # the backbone's names (Qwen3.5 multimodal: model.language_model.)
    text: dict | None = None  # the language model's config (Qwen3.5 multimodal: text_config)

    def layer_at(self, i: int) -> LayerShape:
        """The shape of decoder layer ``i`` (MTP layers: ``i >= num_layers``, MoE as GLM's,
        full attention in Qwen3-Next / Qwen3.5)."""
        if self.layer.num_experts and i < self.first_dense_layers:
            return replace(self.layer, num_experts=0, shared_ffn_hidden_size=0, expert_bias=False)
        if self.layer_types and i < self.num_layers and self.layer_types[i] == "linear_attention":
            return replace(self.layer, linear=True)
        return self.layer


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"Hugging Face directory not found: {hf_dir}")
    if not os.path.isfile(path):
        raise ConvertError(f"missing {path} (a Hugging Face model directory has config.json)")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ConvertError(f"{path} is not valid JSON: {err}") from None


def _rope_scaling(cfg: dict) -> tuple[str, dict]:
    """(rope type, its parameters) from ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return rope_type, {**scaling, **params}


def _rope(cfg: dict) -> tuple[float, float]:
    """(theta, fraction of head dims rotated); only unscaled RoPE (DeepSeek-V3: YaRN, see _yarn)."""
    params = cfg.get("rope_parameters") or {}
    rope_type = _rope_scaling(cfg)[0]
    if rope_type != "default" and not (rope_type == "yarn" and ARCHITECTURES.get(_arch(cfg)) == "deepseek_v3"):
        raise ConvertError(f"rope type {rope_type!r} is not supported yet (only unscaled RoPE; YaRN for DeepSeek-V3)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def _arch(cfg: dict):
    archs = cfg.get("architectures") or []
    return archs[0] if archs else None


def _yarn(cfg: dict) -> dict:
    """DeepSeek-V3's YaRN RoPE as ``ModelConfig`` fields (Megatron's MLA YaRN computes the same
    frequencies, cos/sin factor and softmax scale as transformers' for these parameters)."""
    rope_type, p = _rope_scaling(cfg)
    if rope_type == "default":
        return {"rope_type": "rope"}
    if p.get("attention_factor") is not None or p.get("truncate", True) is not True:
        raise ConvertError("YaRN with attention_factor or truncate=false is not supported (Megatron's YaRN has "
                           "neither option)")
    factor = p.get("factor")
    orig = p.get("original_max_position_embeddings")
    if orig is None:
        raise ConvertError("YaRN rope_scaling without original_max_position_embeddings is not supported")
    if factor is None:
        factor = cfg["max_position_embeddings"] / orig
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        # transformers then scales cos/sin by m(factor, 1) and the softmax by m(factor, mscale_all_dim)**2;
        # Megatron by m(factor, mscale) / m(factor, mscale_all_dim) and m(factor, mscale_all_dim)**2.
        if mscale_all_dim:
            raise ConvertError("YaRN with mscale_all_dim but no mscale is not supported (Megatron's YaRN would "
                               "scale cos/sin differently from transformers')")
        mscale, mscale_all_dim = 1.0, 0.0
    return {
        "rope_type": "yarn",
        "yarn_scaling_factor": float(factor),
        "yarn_original_max_position_embeddings": int(orig),
        "yarn_beta_fast": float(p.get("beta_fast") or 32),
        "yarn_beta_slow": float(p.get("beta_slow") or 1),
        "yarn_mscale": float(mscale),
        "yarn_mscale_all_dim": float(mscale_all_dim),
    }


def describe(cfg: dict) -> HFModel:
    """Parse and check a config; one clear error for anything the key maps cannot represent."""
    arch = _arch(cfg)
    if arch in NOT_YET:
        raise ConvertError(f"architecture {arch} is not supported yet: {NOT_YET[arch]}")
    if arch not in ARCHITECTURES:
        raise ConvertError(
            f"unknown architecture {arch!r} in config.json (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    family = ARCHITECTURES[arch]
    full_cfg = cfg
    cfg, prefix = qwen_config.text_config(cfg) if family in qwen_config.QWEN_HYBRID else (cfg, "model.")
    if cfg.get("quantization_config") or full_cfg.get("quantization_config"):
        q = cfg.get("quantization_config") or full_cfg["quantization_config"]
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise ConvertError(f"quantized checkpoint (quantization_config, {method}) is not supported: convert the "
                           "weights to bf16 first (e.g. DeepSeek's FP8 release)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"hidden_act={cfg['hidden_act']!r}: only SwiGLU (silu) MLPs are supported")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ConvertError("sliding-window attention is not supported (use_sliding_window=true)")
    if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ConvertError("Llama with attention_bias or mlp_bias is not supported (biases on o_proj/MLP)")
    if family in ("qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        raise ConvertError("Qwen3 with attention_bias=true is not supported")
    if family == "deepseek_v3":
        if cfg.get("attention_bias"):
            raise ConvertError("DeepSeek-V3 with attention_bias=true is not supported (biases on the MLA projections)")
        if cfg.get("rope_interleave", True) is False:
            raise ConvertError("DeepSeek-V3 with rope_interleave=false is not supported (Megatron's MLA rotates "
                               "interleaved pairs, as the published checkpoints store them)")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConvertError(f"DeepSeek-V3 with scoring_func={cfg.get('scoring_func')!r} / topk_method="
                               f"{cfg.get('topk_method')!r} is not supported (only sigmoid / noaux_tc)")
        _yarn(cfg)  # refuse unsupported YaRN parameters early
    if family in qwen_config.QWEN_HYBRID:
        qwen_config.check(family, cfg)
    elif family != "glm4_moe" and _rope(cfg)[1] != 1.0:
        raise ConvertError("partial_rotary_factor != 1 is only supported for GLM-4.5 and Qwen3-Next / Qwen3.5")
    heads = cfg["num_attention_heads"]
    num_experts = 0
    moe_ffn = 0
    if family == "qwen3_moe":
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        moe_ffn = cfg["moe_intermediate_size"]
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ConvertError("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
    shared_ffn, first_dense = 0, 0
    if family in NEXTN_MOE:
        num_experts = cfg["n_routed_experts"]
        moe_ffn = cfg["moe_intermediate_size"]
        shared_ffn = moe_ffn * cfg.get("n_shared_experts", 0)
        first_dense = cfg.get("first_k_dense_replace", 0)
        topk, groups, group_topk = cfg["num_experts_per_tok"], cfg.get("n_group", 1), cfg.get("topk_group", 1)
        if topk > 1 and not cfg.get("norm_topk_prob", True):
            raise ConvertError(f"{arch} with norm_topk_prob=false is not supported (Megatron renormalises sigmoid top-k)")
        if groups > 1 and topk // group_topk != 2:
            raise ConvertError(f"n_group={groups}: Megatron scores a group by its top-{topk // group_topk} experts, "
                               "GLM/DeepSeek by the top-2; need num_experts_per_tok / topk_group == 2")
    layer = LayerShape(
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
        qkv_bias=family in ("qwen2", "mimo") or (family == "glm4_moe" and bool(cfg.get("attention_bias"))),
        qk_norm=family in ("qwen3", "qwen3_moe") or (family == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
        num_experts=num_experts,
        moe_ffn_hidden_size=moe_ffn,
        shared_ffn_hidden_size=shared_ffn,
        expert_bias=family in NEXTN_MOE,
    )
    if family == "deepseek_v3":
        layer = replace(layer, num_kv_heads=heads, q_lora_rank=cfg.get("q_lora_rank"),
                        kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                        qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"])
    num_mtp = int(cfg.get("num_nextn_predict_layers", 0) or 0)
    if family in qwen_config.QWEN_HYBRID:
        layer = replace(layer, **qwen_config.layer_fields(family, cfg))
        num_mtp = qwen_config.num_mtp_layers(full_cfg, cfg)
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or full_cfg.get("dtype") or "float32"
    return HFModel(
        family=family,
        config=full_cfg,
        layer=layer,
        num_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
        num_mtp_layers=num_mtp,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", full_cfg.get("tie_word_embeddings", False))),
        dtype=DTYPES.get(dtype_name, torch.float32),
        first_dense_layers=first_dense,
        layer_types=qwen_config.layer_types(cfg) if family in qwen_config.QWEN_HYBRID else None,
        prefix=prefix,
        text=cfg,
    )


def padded_vocab(vocab_size: int, divisible_by: int, max_tensor_parallel: int) -> int:
    """Vocabulary rows in the Megatron checkpoint: unchanged by the builder at every TP dividing
    ``max_tensor_parallel`` (so one converted checkpoint loads at all those layouts)."""
    multiple = divisible_by * max_tensor_parallel
    return -(-vocab_size // multiple) * multiple


def model_overrides(hf: HFModel, vocab_rows: int, divisible_by: int) -> dict:
    """``ModelConfig`` fields (the ``model:`` section of a training config) for this model."""
    c, layer = hf.text or hf.config, hf.layer
    out = {
        "family": "moe" if layer.num_experts else "dense",
        "num_layers": hf.num_layers,
        "hidden_size": layer.hidden_size,
        "ffn_hidden_size": layer.ffn_hidden_size,
        "num_attention_heads": layer.num_heads,
        "num_query_groups": layer.num_kv_heads,
        "kv_channels": layer.head_dim,
        "vocab_size": hf.vocab_size,  # the real vocabulary: the padded rows are masked in the loss
        "padded_vocab_size": vocab_rows,
        "make_vocab_size_divisible_by": divisible_by,
        "max_position_embeddings": c.get("max_position_embeddings", 4096),
        "rotary_base": _rope(c)[0],
        "rotary_percent": _rope(c)[1],
        "norm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        "qk_layernorm": layer.qk_norm,
        "add_qkv_bias": layer.qkv_bias,
        "tie_embeddings": hf.tie_embeddings,
    }
    if layer.num_experts:
        out.update(
            num_experts=layer.num_experts,
            moe_router_topk=c["num_experts_per_tok"],
            moe_ffn_hidden_size=layer.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=None,
            # Qwen3-MoE: softmax over all experts, top-k, renormalised iff norm_topk_prob.
            # Megatron: top-k of the logits then softmax (= renormalised), or softmax first.
            moe_router_pre_softmax=not c.get("norm_topk_prob", False),
        )
    if hf.family in qwen_config.QWEN_HYBRID:
        out.update(qwen_config.model_fields(hf.family, c, layer))
    if hf.family in NEXTN_MOE:
        groups = c.get("n_group", 1)
        out.update(
            moe_router_pre_softmax=False,
            moe_shared_expert_intermediate_size=layer.shared_ffn_hidden_size or None,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=c.get("topk_group") if groups > 1 else None,
            moe_router_topk_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            moe_first_dense_layers=hf.first_dense_layers,
        )
    if layer.mla:
        out.update(
            num_query_groups=layer.num_heads,
            kv_channels=layer.v_head_dim,
            qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
            rotary_percent=1.0,
            multi_latent_attention=True,
            q_lora_rank=layer.q_lora_rank,
            kv_lora_rank=layer.kv_lora_rank,
            qk_head_dim=layer.qk_nope_head_dim,
            qk_pos_emb_head_dim=layer.qk_rope_head_dim,
            v_head_dim=layer.v_head_dim,
            **_yarn(c),
        )
    return out
