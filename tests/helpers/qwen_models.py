"""Tiny random Qwen3-Next / Qwen3.5 models (transformers' classes) with MTP weights, saved locally.

Two layers, one of each kind (``linear_attention`` then ``full_attention``), fp32, hidden 64.
transformers' ``save_pretrained`` leaves the MTP weights out (its classes have none); the
published checkpoints store them as top-level ``mtp.*``: random ones with those names are
added, so that the import maps them and the export writes them back. ``qwen3_5_mm`` is the
multimodal release's layout (``Qwen3_5ForConditionalGeneration``: ``model.language_model.*``,
``text_config``, a one-block vision tower).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.convert_models import split_experts
from tests.helpers.data import make_hf_tokenizer

QWEN_FAMILIES = ("qwen3_5", "qwen3_5_mm", "qwen3_5_moe", "qwen3_next")
TEXT = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
            layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def text_config(family: str, tie: bool = False):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    text = {**TEXT, "tie_word_embeddings": tie}
    if family == "qwen3_next":
        return Qwen3NextConfig(**text, **MOE, intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1)
    if family == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(**text, **MOE)
    return Qwen3_5TextConfig(**text, intermediate_size=96)


def mtp_tensors(cfg, seed: int = 7) -> dict[str, torch.Tensor]:
    """One MTP layer with the published names: mtp.fc / pre_fc_norm_* / norm, mtp.layers.0.* (full attention)."""
    import importlib

    module = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}[cfg.model_type]
    prefix = {"qwen3_next": "Qwen3Next", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[module]
    layer_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), prefix + "DecoderLayer")
    sd = layer_cls(cfg, layer_idx=cfg.layer_types.index("full_attention")).state_dict()
    if "mlp.experts.gate_up_proj" in sd:  # per-expert names, as the checkpoints store them
        split_experts(sd, cfg.num_experts, cfg.moe_intermediate_size)
    g = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size
    out = {f"mtp.layers.0.{k}": torch.randn(t.shape, generator=g) * (0.1 if t.dim() > 1 else 0.2) for k, t in sd.items()}
    out["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # zero-centred: 1 + w
        out[f"mtp.{norm}.weight"] = 0.2 * torch.randn(H, generator=g)
    return out


def make_qwen_model(family: str, path: Path, seed: int = 0, with_mtp: bool = True,
                    dtype: torch.dtype = torch.float32, tie: bool = False) -> Path:
    """Save a random model (norms away from their neutral value) with MTP weights and a tokenizer;
    ``tie``: tied embedding and head (small Qwen3.5 models), text-only layouts."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    text = text_config(family, tie)
    if family == "qwen3_5_mm":
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        cfg = Qwen3_5Config(text_config=text.to_dict(), vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16), tie_word_embeddings=False)
        model = Qwen3_5ForConditionalGeneration(cfg).float()
    else:
        model = AutoModelForCausalLM.from_config(text).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(str(path))
    make_hf_tokenizer(path)
    conf = json.loads((path / "config.json").read_text())
    if with_mtp:
        weights = load_file(str(path / "model.safetensors"))
        weights.update({k: v.to(dtype) for k, v in mtp_tensors(text).items()})
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        if family == "qwen3_next":
            conf["num_nextn_predict_layers"] = 1
        else:
            (conf["text_config"] if "text_config" in conf else conf)["mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(conf, indent=2))
    return path


def hf_logits(path: Path, family: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits of the backbone."""
    from transformers import AutoModelForCausalLM

    if family == "qwen3_5_mm":
        from transformers import Qwen3_5ForConditionalGeneration as cls
    else:
        cls = AutoModelForCausalLM
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()
