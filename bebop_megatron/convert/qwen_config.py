"""Qwen3-Next and Qwen3.5 (dense, MoE; text-only or the multimodal release) ``config.json`` -> shapes.

Qwen3.5's published checkpoints are ``Qwen3_5ForConditionalGeneration``: the language model's
config is ``text_config`` and its weights sit under ``model.language_model.*`` next to a vision
tower (``model.visual.*``, kept aside by the import, see ``convert/importer.py``). Text-only
positions make Qwen3.5's interleaved multimodal RoPE (``mrope_section``) equal plain RoPE, so
it imports as RoPE with ``partial_rotary_factor``.
"""

from __future__ import annotations

from bebop_megatron.convert.errors import ConvertError

QWEN_HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}


def text_config(cfg: dict) -> tuple[dict, str]:
    """(the language model's config, the prefix of its weights)."""
    if isinstance(cfg.get("text_config"), dict):
        return cfg["text_config"], "model.language_model."
    return cfg, "model."


def layer_types(text: dict) -> list[str]:
    types = text.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
        interval = text.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(text["num_hidden_layers"])]
    if len(types) != text["num_hidden_layers"]:
        raise ConvertError(f"layer_types has {len(types)} entries but num_hidden_layers={text['num_hidden_layers']}")
    bad = sorted({t for t in types if t not in ("full_attention", "linear_attention")})
    if bad:
        raise ConvertError(f"layer_types: unknown layer type {bad[0]!r} (only full_attention and linear_attention)")
    return list(types)


def check(family: str, text: dict) -> None:
    """One clear error for what the Megatron model cannot represent."""
    if text.get("attention_bias"):
        raise ConvertError(f"{family} with attention_bias=true is not supported (biases on q/k/v/o_proj)")
    if family == "qwen3_next" and (text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1):
        raise ConvertError("Qwen3-Next with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
    if family != "qwen3_5" and not text.get("shared_expert_intermediate_size"):
        raise ConvertError(f"{family} without a shared expert (shared_expert_intermediate_size=0) is not supported")
    if text.get("linear_num_value_heads", 1) % text.get("linear_num_key_heads", 1):
        raise ConvertError("linear_num_value_heads must be a multiple of linear_num_key_heads")


def layer_fields(family: str, text: dict) -> dict:
    """``LayerShape`` fields of a Qwen3-Next / Qwen3.5 decoder layer."""
    out = dict(output_gate=True, qk_norm=True, gdn_grouped=family == "qwen3_next",
               linear_num_key_heads=text["linear_num_key_heads"],
               linear_num_value_heads=text["linear_num_value_heads"],
               linear_key_head_dim=text["linear_key_head_dim"],
               linear_value_head_dim=text["linear_value_head_dim"])
    if family != "qwen3_5":
        out.update(num_experts=text["num_experts"], moe_ffn_hidden_size=text["moe_intermediate_size"],
                   shared_ffn_hidden_size=text["shared_expert_intermediate_size"], shared_expert_gate=True)
    return out


def num_mtp_layers(cfg: dict, text: dict) -> int:
    """MTP layers the config announces (Qwen3.5: text_config.mtp_num_hidden_layers; Qwen3-Next's
    vLLM reads num_nextn_predict_layers); the import also counts the ``mtp.layers.*`` it finds."""
    return int(text.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)


def model_fields(family: str, text: dict, layer) -> dict:
    """``ModelConfig`` fields beyond the common ones."""
    out = dict(layer_types=layer_types(text), attention_output_gate=True, zero_centered_norms=True,
               qk_layernorm=True, linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
               linear_key_head_dim=layer.linear_key_head_dim, linear_value_head_dim=layer.linear_value_head_dim,
               linear_num_key_heads=layer.linear_num_key_heads, linear_num_value_heads=layer.linear_num_value_heads)
    if layer.num_experts:
        out.update(moe_shared_expert_intermediate_size=layer.shared_ffn_hidden_size, moe_shared_expert_gate=True,
                   # softmax over all experts, top-k, renormalised (Qwen3.5-MoE always; Qwen3-Next with
                   # norm_topk_prob): Megatron's top-k logits then softmax.
                   moe_router_pre_softmax=family == "qwen3_next" and not text.get("norm_topk_prob", True))
    return out
