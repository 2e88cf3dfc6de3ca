"""The decoder-layer key map between Megatron (TP=1, local spec) and Hugging Face names.

Megatron fuses Q, K and V into ``linear_qkv`` grouped per key/value head: for each of the
``G`` groups, the group's ``heads/G`` query heads, then its key head, then its value head
(each ``head_dim`` rows). Gate and up are fused into ``linear_fc1`` as ``[gate; up]``.
HF names are those of Llama/Qwen2/Qwen3 (``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``), Qwen3-MoE (``mlp.gate``, ``mlp.experts.{j}.*``) and GLM-4.5
(plus ``mlp.gate.e_score_correction_bias`` and ``mlp.shared_experts.*``).

DeepSeek-V3's Multi-Latent Attention maps one to one, without reordering:
``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj``) -> ``linear_q_down_proj`` /
``q_layernorm`` / ``linear_q_up_proj`` (or ``linear_q_proj``); ``kv_a_proj_with_mqa`` /
``kv_a_layernorm`` / ``kv_b_proj`` -> ``linear_kv_down_proj`` / ``kv_layernorm`` /
``linear_kv_up_proj``; ``o_proj`` -> ``linear_proj``. Both lay each query head out as
``[nope; rope]``, the key/value latent as ``[latent; rope]`` and each up-projected key/value
head as ``[nope; v]``, and both rotate the rope dimensions as interleaved pairs
(transformers' ``rope_interleave=True``, Megatron's ``mla_rotary_interleaved``).
"""

from __future__ import annotations

import torch

from bebop_megatron.convert import qwen_hybrid
from bebop_megatron.convert.hf_config import LayerShape


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """``[q; k; v]`` (HF, heads contiguous) -> Megatron's per-group interleaved ``linear_qkv``."""
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    tail = q.shape[1:]
    parts = (q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    groups, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    tail = qkv.shape[1:]
    g = qkv.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = torch.split(g, [per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _mlp_to_megatron(get, hf: str, meg: str) -> dict:
    return {
        f"{meg}linear_fc1.weight": torch.cat([get(f"{hf}gate_proj.weight"), get(f"{hf}up_proj.weight")]),
        f"{meg}linear_fc2.weight": get(f"{hf}down_proj.weight"),
    }


def _mlp_to_hf(sd: dict, meg: str, hf: str) -> dict:
    gate, up = torch.chunk(sd[f"{meg}linear_fc1.weight"], 2, dim=0)
    return {
        f"{hf}gate_proj.weight": gate,
        f"{hf}up_proj.weight": up,
        f"{hf}down_proj.weight": sd[f"{meg}linear_fc2.weight"],
    }


# Multi-Latent Attention: Megatron name (under ``self_attention.``) -> HF name (under ``self_attn.``).
MLA_NAMES = {
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}
MLA_Q_LORA_NAMES = {
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
}
MLA_Q_NAMES = {"linear_q_proj.weight": "q_proj.weight"}


def mla_names(shape: LayerShape) -> dict[str, str]:
    return {**(MLA_Q_LORA_NAMES if shape.q_lora_rank is not None else MLA_Q_NAMES), **MLA_NAMES}


def layer_to_megatron(get, hf: str, meg: str, shape: LayerShape) -> dict:
    """One decoder layer: ``get(hf_name)`` returns an HF tensor; returns Megatron tensors.

    ``hf`` is e.g. ``model.layers.3.``, ``meg`` e.g. ``decoder.layers.3.``.
    """
    out = {
        f"{meg}input_layernorm.weight": get(f"{hf}input_layernorm.weight"),
        f"{meg}pre_mlp_layernorm.weight": get(f"{hf}post_attention_layernorm.weight"),
    }
    if shape.linear:  # Gated DeltaNet (Qwen3-Next / Qwen3.5)
        out.update(qwen_hybrid.gdn_to_megatron(get, f"{hf}linear_attn.", f"{meg}self_attention.", shape))
    elif shape.output_gate:
        out[f"{meg}self_attention.linear_qkv.weight"] = qwen_hybrid.gated_qkv_to_megatron(get, f"{hf}self_attn.", shape)
        out[f"{meg}self_attention.linear_proj.weight"] = get(f"{hf}self_attn.o_proj.weight")
    elif shape.mla:
        out.update({f"{meg}self_attention.{m}": get(f"{hf}self_attn.{h}") for m, h in mla_names(shape).items()})
    else:
        out[f"{meg}self_attention.linear_qkv.weight"] = fuse_qkv(
            get(f"{hf}self_attn.q_proj.weight"), get(f"{hf}self_attn.k_proj.weight"),
            get(f"{hf}self_attn.v_proj.weight"), shape)
        out[f"{meg}self_attention.linear_proj.weight"] = get(f"{hf}self_attn.o_proj.weight")
    if shape.qkv_bias:
        out[f"{meg}self_attention.linear_qkv.bias"] = fuse_qkv(
            get(f"{hf}self_attn.q_proj.bias"), get(f"{hf}self_attn.k_proj.bias"),
            get(f"{hf}self_attn.v_proj.bias"), shape)
    if shape.qk_norm and not shape.mla and not shape.linear:
        out[f"{meg}self_attention.q_layernorm.weight"] = get(f"{hf}self_attn.q_norm.weight")
        out[f"{meg}self_attention.k_layernorm.weight"] = get(f"{hf}self_attn.k_norm.weight")
    if shape.num_experts:
        out[f"{meg}mlp.router.weight"] = get(f"{hf}mlp.gate.weight")
        if shape.expert_bias:
            out[f"{meg}mlp.router.expert_bias"] = get(f"{hf}mlp.gate.e_score_correction_bias").float()
        for j in range(shape.num_experts):
            out.update(_mlp_to_megatron(get, f"{hf}mlp.experts.{j}.", f"{meg}mlp.experts.local_experts.{j}."))
        if shape.shared_expert_gate:  # Qwen3-Next / Qwen3.5-MoE: one shared expert and its sigmoid gate
            out.update(_mlp_to_megatron(get, f"{hf}mlp.shared_expert.", f"{meg}mlp.shared_experts."))
            out[f"{meg}mlp.shared_experts.gate_weight"] = get(f"{hf}mlp.shared_expert_gate.weight")
        elif shape.shared_ffn_hidden_size:
            out.update(_mlp_to_megatron(get, f"{hf}mlp.shared_experts.", f"{meg}mlp.shared_experts."))
    else:
        out.update(_mlp_to_megatron(get, f"{hf}mlp.", f"{meg}mlp."))
    return out


def layer_to_hf(sd: dict, meg: str, hf: str, shape: LayerShape, qkv_bias: bool | None = None) -> dict:
    """Inverse of :func:`layer_to_megatron`. ``qkv_bias=True`` on a model without biases
    writes zero biases (formats whose engine layer always has them, e.g. MiMo's Qwen2 layer)."""
    out = {
        f"{hf}input_layernorm.weight": sd[f"{meg}input_layernorm.weight"],
        f"{hf}post_attention_layernorm.weight": sd[f"{meg}pre_mlp_layernorm.weight"],
    }
    if shape.mla or shape.linear or shape.output_gate:
        if shape.linear:
            out.update(qwen_hybrid.gdn_to_hf(sd, f"{meg}self_attention.", f"{hf}linear_attn.", shape))
        elif shape.output_gate:
            out.update(qwen_hybrid.gated_qkv_to_hf(sd[f"{meg}self_attention.linear_qkv.weight"], f"{hf}self_attn.", shape))
            out[f"{hf}self_attn.o_proj.weight"] = sd[f"{meg}self_attention.linear_proj.weight"]
            out[f"{hf}self_attn.q_norm.weight"] = sd[f"{meg}self_attention.q_layernorm.weight"]
            out[f"{hf}self_attn.k_norm.weight"] = sd[f"{meg}self_attention.k_layernorm.weight"]
        else:
            out.update({f"{hf}self_attn.{h}": sd[f"{meg}self_attention.{m}"] for m, h in mla_names(shape).items()})
        out.update(_mlp_layer_to_hf(sd, meg, hf, shape))
        return out
    q, k, v = split_qkv(sd[f"{meg}self_attention.linear_qkv.weight"], shape)
    out.update({
        f"{hf}self_attn.q_proj.weight": q,
        f"{hf}self_attn.k_proj.weight": k,
        f"{hf}self_attn.v_proj.weight": v,
        f"{hf}self_attn.o_proj.weight": sd[f"{meg}self_attention.linear_proj.weight"],
    })
    want_bias = shape.qkv_bias if qkv_bias is None else qkv_bias
    if want_bias:
        bias = sd.get(f"{meg}self_attention.linear_qkv.bias")
        if bias is None:
            bias = q.new_zeros(q.shape[0] + k.shape[0] + v.shape[0])
            bq, bk, bv = torch.split(bias, [q.shape[0], k.shape[0], v.shape[0]])
        else:
            bq, bk, bv = split_qkv(bias, shape)
        out.update({f"{hf}self_attn.q_proj.bias": bq, f"{hf}self_attn.k_proj.bias": bk,
                    f"{hf}self_attn.v_proj.bias": bv})
    if shape.qk_norm:
        out[f"{hf}self_attn.q_norm.weight"] = sd[f"{meg}self_attention.q_layernorm.weight"]
        out[f"{hf}self_attn.k_norm.weight"] = sd[f"{meg}self_attention.k_layernorm.weight"]
    out.update(_mlp_layer_to_hf(sd, meg, hf, shape))
    return out


def _mlp_layer_to_hf(sd: dict, meg: str, hf: str, shape: LayerShape) -> dict:
    out = {}
    if shape.num_experts:
        out[f"{hf}mlp.gate.weight"] = sd[f"{meg}mlp.router.weight"]
        if shape.expert_bias:
            out[f"{hf}mlp.gate.e_score_correction_bias"] = sd[f"{meg}mlp.router.expert_bias"]
        for j in range(shape.num_experts):
            out.update(_mlp_to_hf(sd, f"{meg}mlp.experts.local_experts.{j}.", f"{hf}mlp.experts.{j}."))
        if shape.shared_expert_gate:
            out.update(_mlp_to_hf(sd, f"{meg}mlp.shared_experts.", f"{hf}mlp.shared_expert."))
            out[f"{hf}mlp.shared_expert_gate.weight"] = sd[f"{meg}mlp.shared_experts.gate_weight"]
        elif shape.shared_ffn_hidden_size:
            out.update(_mlp_to_hf(sd, f"{meg}mlp.shared_experts.", f"{hf}mlp.shared_experts."))
    else:
        out.update(_mlp_to_hf(sd, f"{meg}mlp.", f"{hf}mlp."))
    return out
