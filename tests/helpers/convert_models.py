"""Tiny random Hugging Face models (transformers' config classes), saved to local directories.

MiMo has no transformers class: its checkpoint is a Qwen2 model plus ``model.mtp_layers.{i}``
tensors and ``num_nextn_predict_layers`` in config.json, as the published MiMo-7B ships it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.data import make_hf_tokenizer

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mimo", "glm4_moe", "deepseek_v3")
NEXTN_FAMILIES = ("glm4_moe", "deepseek_v3")  # NextN MTP layers at model.layers.{N+i}


def hf_config(family: str, **overrides):
    """``overrides`` replace COMMON's values (Llama, Qwen2 and MiMo)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = {**COMMON, **overrides}
    if family == "llama":
        return LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False)
    if family in ("qwen2", "mimo"):
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=family == "qwen2")
    if family == "qwen3":  # head_dim != hidden / heads, as in real Qwen3 models
        return Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)
    if family == "glm4_moe":  # dense first layer, shared expert, sigmoid router with bias, half RoPE
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(**COMMON, head_dim=16, partial_rotary_factor=0.5, moe_intermediate_size=32,
                             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                             n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                             attention_bias=True, use_qk_norm=False, tie_word_embeddings=False,
                             num_nextn_predict_layers=1)
    if family in ("deepseek_v3", "deepseek_v3_yarn"):  # MLA, dense first layer, grouped sigmoid router
        from transformers import DeepseekV3Config

        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if family == "deepseek_v3_yarn":  # DeepSeek-V3's long-context RoPE (cos/sin and softmax scaled)
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
        return DeepseekV3Config(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=rope, tie_word_embeddings=False,
            num_nextn_predict_layers=1)
    raise ValueError(family)


def split_experts(sd: dict, num_experts: int, inter: int) -> None:
    """transformers' fused ``mlp.experts.gate_up_proj`` / ``down_proj`` of a decoder layer's
    state dict -> one ``gate_proj`` / ``up_proj`` / ``down_proj`` per expert, as the
    checkpoints store them (in place)."""
    gate_up, down = sd.pop("mlp.experts.gate_up_proj"), sd.pop("mlp.experts.down_proj")
    for j in range(num_experts):
        sd[f"mlp.experts.{j}.gate_proj.weight"] = gate_up[j, :inter]
        sd[f"mlp.experts.{j}.up_proj.weight"] = gate_up[j, inter:]
        sd[f"mlp.experts.{j}.down_proj.weight"] = down[j]


def glm_mtp_tensors(cfg, model, num_mtp: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """GLM-4.5 / DeepSeek-V3 NextN layers ``model.layers.{N+i}`` as the published checkpoints
    store them (per-expert names; embedding and head copies in each layer)."""
    if cfg.model_type == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer as DecoderLayer
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer as DecoderLayer

    g = torch.Generator().manual_seed(seed)
    N, H = cfg.num_hidden_layers, cfg.hidden_size
    out = {}
    for i in range(num_mtp):
        p = f"model.layers.{N + i}."
        sd = DecoderLayer(cfg, layer_idx=N + i).state_dict()
        split_experts(sd, cfg.n_routed_experts, cfg.moe_intermediate_size)
        for name, t in sd.items():
            out[p + name] = torch.randn(t.shape, generator=g) * (0.1 if t.dim() > 1 else 0.2) + (t.dim() == 1)
        out[p + "mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(cfg.n_routed_experts, generator=g)
        out[p + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 0.1
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[f"{p}{norm}.weight"] = 1 + 0.2 * torch.randn(H, generator=g)
        out[p + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        out[p + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def mimo_mtp_tensors(cfg, num_mtp: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random MiMo MTP layers with the names and shapes of the published checkpoints."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    g = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size
    out = {}
    for i in range(num_mtp):
        layer = Qwen2DecoderLayer(cfg, layer_idx=0)
        p = f"model.mtp_layers.{i}."
        for name, t in layer.state_dict().items():
            out[p + name] = torch.randn(t.shape, generator=g) * (0.1 if t.dim() > 1 else 0.2) + (t.dim() == 1)
        out[p + "input_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 0.1
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            out[f"{p}{norm}.weight"] = 1 + 0.2 * torch.randn(H, generator=g)
    return out


def make_hf_model(family: str, path: Path, num_mtp: int = 1, seed: int = 0,
                  dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save a random model of ``family`` (with norms away from 1) and a tokenizer to ``path``;
    ``overrides``: config values replacing COMMON's (Llama, Qwen2, MiMo)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.helpers import qwen_models

    if family in qwen_models.QWEN_FAMILIES:
        return qwen_models.make_qwen_model(family, path, seed)
    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # random norms and biases, so that a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # routing depends on it: make it matter
                b.copy_(0.1 * torch.randn_like(b))
    model.to(dtype)
    for name, b in model.named_buffers():  # GLM keeps its router bias in float32, as published
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()
    model.save_pretrained(str(path))
    make_hf_tokenizer(path)
    if cfg.model_type in NEXTN_FAMILIES:
        weights = load_file(str(path / "model.safetensors"))
        extra = glm_mtp_tensors(cfg, model, num_mtp)
        weights.update({k: v if k.endswith("e_score_correction_bias") else v.to(dtype) for k, v in extra.items()})
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        if num_mtp != 1:
            conf = json.loads((path / "config.json").read_text())
            conf["num_nextn_predict_layers"] = num_mtp
            (path / "config.json").write_text(json.dumps(conf, indent=2))
    if family == "mimo":
        weights = load_file(str(path / "model.safetensors"))
        weights.update({k: v.to(dtype) for k, v in mimo_mtp_tensors(cfg, num_mtp).items()})
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        conf = json.loads((path / "config.json").read_text())
        conf.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=num_mtp)
        (path / "config.json").write_text(json.dumps(conf, indent=2))
    return path


def hf_logits(path: Path, family: str, tokens: torch.Tensor) -> torch.Tensor:
    """The transformers model's float32 logits (MiMo: its Qwen2 backbone)."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from tests.helpers import qwen_models

    if family in qwen_models.QWEN_FAMILIES:
        return qwen_models.hf_logits(path, family, tokens)
    if family == "mimo":
        model = Qwen2ForCausalLM.from_pretrained(str(path), config=hf_config("mimo"), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()
