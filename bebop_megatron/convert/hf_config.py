"""Supported Hugging Face architectures and the bebop ``ModelConfig`` fields they map to."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

from bebop_megatron.convert.errors import ConvertError

# HF ``architectures[0]`` -> family name used by the key maps.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MiMoForCausalLM": "mimo",
    "Glm4MoeForCausalLM": "glm4_moe",
}
# Named in the issue but not implemented yet: refused with this reason.
NOT_YET = {
    "DeepseekV3ForCausalLM": ("DeepSeek-V3 needs MLA attention, which Megatron-Core 0.19 builds only with "
                              "Transformer Engine attention (its local attention refuses MLA's head dims)"),
}
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

    def layer_at(self, i: int) -> LayerShape:
        """The shape of decoder layer ``i`` (MTP layers: ``i >= num_layers``, MoE as GLM's)."""
        if self.layer.num_experts and i < self.first_dense_layers:
            return replace(self.layer, num_experts=0, shared_ffn_hidden_size=0, expert_bias=False)
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


def _rope(cfg: dict) -> tuple[float, float]:
    """(theta, fraction of head dims rotated); only unscaled RoPE."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConvertError(f"rope type {rope_type!r} is not supported yet (only unscaled RoPE)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def describe(cfg: dict) -> HFModel:
    """Parse and check a config; one clear error for anything the key maps cannot represent."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch in NOT_YET:
        raise ConvertError(f"architecture {arch} is not supported yet: {NOT_YET[arch]}")
    if arch not in ARCHITECTURES:
        raise ConvertError(
            f"unknown architecture {arch!r} in config.json (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    family = ARCHITECTURES[arch]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"hidden_act={cfg['hidden_act']!r}: only SwiGLU (silu) MLPs are supported")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ConvertError("sliding-window attention is not supported (use_sliding_window=true)")
    if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ConvertError("Llama with attention_bias or mlp_bias is not supported (biases on o_proj/MLP)")
    if family in ("qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        raise ConvertError("Qwen3 with attention_bias=true is not supported")
    if family != "glm4_moe" and _rope(cfg)[1] != 1.0:
        raise ConvertError("partial_rotary_factor != 1 is only supported for GLM-4.5")
    heads = cfg["num_attention_heads"]
    num_experts = 0
    moe_ffn = 0
    if family == "qwen3_moe":
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        moe_ffn = cfg["moe_intermediate_size"]
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ConvertError("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
    shared_ffn, first_dense = 0, 0
    if family == "glm4_moe":
        num_experts = cfg["n_routed_experts"]
        moe_ffn = cfg["moe_intermediate_size"]
        shared_ffn = moe_ffn * cfg.get("n_shared_experts", 0)
        first_dense = cfg.get("first_k_dense_replace", 0)
        topk, groups, group_topk = cfg["num_experts_per_tok"], cfg.get("n_group", 1), cfg.get("topk_group", 1)
        if topk > 1 and not cfg.get("norm_topk_prob", True):
            raise ConvertError("GLM-4.5 with norm_topk_prob=false is not supported (Megatron renormalises sigmoid top-k)")
        if groups > 1 and topk // group_topk != 2:
            raise ConvertError(f"n_group={groups}: Megatron scores a group by its top-{topk // group_topk} experts, "
                               "GLM/DeepSeek by the top-2; need num_experts_per_tok / topk_group == 2")
    layer = LayerShape(
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg["intermediate_size"],
        qkv_bias=family in ("qwen2", "mimo") or (family == "glm4_moe" and bool(cfg.get("attention_bias"))),
        qk_norm=family in ("qwen3", "qwen3_moe") or (family == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
        num_experts=num_experts,
        moe_ffn_hidden_size=moe_ffn,
        shared_ffn_hidden_size=shared_ffn,
        expert_bias=family == "glm4_moe",
    )
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return HFModel(
        family=family,
        config=cfg,
        layer=layer,
        num_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=DTYPES.get(dtype_name, torch.float32),
        first_dense_layers=first_dense,
    )


def padded_vocab(vocab_size: int, divisible_by: int, max_tensor_parallel: int) -> int:
    """Vocabulary rows in the Megatron checkpoint: unchanged by the builder at every TP dividing
    ``max_tensor_parallel`` (so one converted checkpoint loads at all those layouts)."""
    multiple = divisible_by * max_tensor_parallel
    return -(-vocab_size // multiple) * multiple


def model_overrides(hf: HFModel, vocab_rows: int, divisible_by: int) -> dict:
    """``ModelConfig`` fields (the ``model:`` section of a training config) for this model."""
    c, layer = hf.config, hf.layer
    out = {
        "family": "moe" if layer.num_experts else "dense",
        "num_layers": hf.num_layers,
        "hidden_size": layer.hidden_size,
        "ffn_hidden_size": layer.ffn_hidden_size,
        "num_attention_heads": layer.num_heads,
        "num_query_groups": layer.num_kv_heads,
        "kv_channels": layer.head_dim,
        "vocab_size": vocab_rows,
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
    if hf.family == "glm4_moe":
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
    return out
