"""Tiny MiMo models whose MTP draft accepts often, for serving in vLLM (tests/test_serve_vllm.py).

A random MTP layer almost never predicts a random backbone's text, so counts of accepted
drafts would be all zero and prove little. Here the backbone has one decoder layer and the
MTP layer is a copy of it, fed mostly the token embedding (``input_proj`` = ``[a R | s I]``:
a small random map of the hidden state, ``s`` the embedding rows' RMS on the identity) and
normed with the backbone's final norm: the draft at position t sees tokens 1..t+1 as the
backbone at t+1 sees tokens 0..t+1, so it predicts token t+2 as the backbone does, most of the
time, and the hidden-state part makes which hidden state the engine hands it matter.
vLLM's CPU attention needs a head size of at least 32: hidden 64 with 2 heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.convert_models import make_hf_model

SERVE_SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)


def make_mimo_shifted(path: Path, seed: int = 0, hidden_weight: float = 0.5) -> Path:
    from safetensors.torch import load_file, save_file

    make_hf_model("mimo", path, seed=seed, **SERVE_SHAPE)
    w = load_file(str(path / "model.safetensors"))
    H = w["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    p, b = "model.mtp_layers.0.", "model.layers.0."
    for name in [k for k in w if k.startswith(b)]:
        w[p + name[len(b):]] = w[name].clone()
    s = w["model.embed_tokens.weight"].pow(2).mean().sqrt()
    proj = s * torch.cat([hidden_weight * torch.randn(H, H, generator=g) / H ** 0.5, torch.eye(H)], dim=1)
    w[p + "input_proj.weight"] = proj.contiguous()
    w[p + "token_layernorm.weight"] = torch.ones(H)
    w[p + "hidden_layernorm.weight"] = 1 + 0.2 * torch.randn(H, generator=g)
    w[p + "final_layernorm.weight"] = w["model.norm.weight"].clone()
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((path / "config.json").read_text())
    assert conf["num_nextn_predict_layers"] == 1
    return path


def deepseek_serve_config(family: str = "deepseek_v3", **_):
    """DeepSeek-V3 (MLA, MoE) at the sizes vLLM's CPU MLA kernel runs: a latent cache of
    kv_lora_rank 512 + qk_rope_head_dim 64 = 576 and v_head_dim 512 (cpu_mla.py); one decoder layer,
    MoE (first_k_dense_replace 0), so that the NextN layer can copy it."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=512, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, num_nextn_predict_layers=1)


def make_deepseek_shifted(path: Path, seed: int = 0, hidden_weight: float = 0.5) -> Path:
    """The MiMo construction above for DeepSeek-V3's NextN layer ``model.layers.1``: a copy of
    the one (MoE, MLA) decoder layer, ``eh_proj`` = ``s [I | a R]`` (embedding half first)."""
    from unittest import mock

    from safetensors.torch import load_file, save_file

    from tests.helpers import convert_models

    with mock.patch.object(convert_models, "hf_config", deepseek_serve_config):
        make_hf_model("deepseek_v3", path, seed=seed)
    w = load_file(str(path / "model.safetensors"))
    H = w["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    p, b = "model.layers.1.", "model.layers.0."
    for name in [k for k in w if k.startswith(b)]:
        w[p + name[len(b):]] = w[name].clone()
    s = w["model.embed_tokens.weight"].float().pow(2).mean().sqrt()
    w[p + "eh_proj.weight"] = (s * torch.cat([torch.eye(H), hidden_weight * torch.randn(H, H, generator=g) / H ** 0.5],
                                             dim=1)).contiguous()
    w[p + "enorm.weight"] = torch.ones(H)
    w[p + "hnorm.weight"] = 1 + 0.2 * torch.randn(H, generator=g)
    w[p + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
