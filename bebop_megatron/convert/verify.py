"""``--verify``: reload the written files, check names and shapes, and recompute the draft
logits with an independent pure-PyTorch MTP forward written from the format description.

The reference uses transformers' own decoder-layer, RMSNorm and rotary classes for the
block and plain torch for the rest; it never touches Megatron modules. It follows
Megatron's training semantics: MTP step k at position t combines the step k-1 hidden state
at t (the backbone's, after its final norm, for k=1) with the embedding of token t+k.
(vLLM and SGLang also zero the embedding at position 0; training does not, so neither does
the comparison.)

Legend: B batch, S sequence, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bebop_megatron.convert.errors import ConvertError

DROP = ("architectures", "model_type", "auto_map", "transformers_version", "num_nextn_predict_layers")


def qwen2_config(cfg: dict):
    from transformers import Qwen2Config

    qcfg = Qwen2Config(**{k: v for k, v in cfg.items() if k not in DROP})
    qcfg._attn_implementation = "eager"
    return qcfg


def check_keys(tensors: dict, expected: dict) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ConvertError(f"written key set differs from the format: missing {missing[:3]} ({len(missing)}), "
                           f"unexpected {extra[:3]} ({len(extra)})")
    wrong = [(k, tuple(tensors[k].shape), expected[k]) for k in expected if tuple(tensors[k].shape) != expected[k]]
    if wrong:
        raise ConvertError(f"written shapes differ from the format, e.g. {wrong[0][0]}: {wrong[0][1]} vs {wrong[0][2]}")


def _causal_mask(B: int, L: int) -> torch.Tensor:
    mask = torch.full((L, L), torch.finfo(torch.float32).min).triu(1)
    return mask.expand(B, 1, L, L)


def _rms(weight: torch.Tensor, eps: float):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(weight.shape[0], eps=eps)
    norm.weight.data.copy_(weight.float())
    return norm


@torch.no_grad()
def mimo_backbone_hidden(tensors: dict, cfg: dict, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen2 model on the written backbone tensors: (final hidden [B,S,H], logits)."""
    from transformers import Qwen2ForCausalLM

    qcfg = qwen2_config(cfg)
    model = Qwen2ForCausalLM(qcfg).float().eval()
    sd = {k: v.float() for k, v in tensors.items() if not k.startswith("model.mtp_layers.")}
    if qcfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise ConvertError(f"written backbone does not load into transformers' Qwen2: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    hidden = model.model(tokens_BS).last_hidden_state  # after the final norm
    return hidden, model.lm_head(hidden)


@torch.no_grad()
def mimo_draft_logits(tensors: dict, cfg: dict, hidden_BSH: torch.Tensor, tokens_BS: torch.Tensor,
                      num_mtp: int, pre_norm: bool = False) -> list[torch.Tensor]:
    """MiMo MTP chain: ``input_proj(cat(hidden_layernorm(h), token_layernorm(emb)))``, a Qwen2
    decoder layer, ``final_layernorm``, ``lm_head``; step k's logits are ``[B, S-k, V]``. The
    next step gets the ``final_layernorm`` output (``pre_norm``: the layer output before it)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    qcfg = qwen2_config(cfg)
    eps = qcfg.rms_norm_eps
    emb = tensors["model.embed_tokens.weight"].float()
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).float()
    rotary = Qwen2RotaryEmbedding(config=qcfg)
    B, S = tokens_BS.shape
    h = hidden_BSH.float()
    out = []
    for k in range(1, num_mtp + 1):
        p = f"model.mtp_layers.{k - 1}."
        L = S - k
        e = F.embedding(tokens_BS[:, k:k + L], emb)
        x = torch.cat([_rms(tensors[p + "hidden_layernorm.weight"], eps)(h[:, :L]),
                       _rms(tensors[p + "token_layernorm.weight"], eps)(e)], dim=-1)
        x = x @ tensors[p + "input_proj.weight"].float().T
        layer = Qwen2DecoderLayer(qcfg, layer_idx=0).float().eval()
        own = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")
        layer.load_state_dict({k2[len(p):]: v.float() for k2, v in tensors.items()
                               if k2.startswith(p) and not k2[len(p):].startswith(own)}, strict=True)
        pos = torch.arange(L).unsqueeze(0).expand(B, L)
        cos_sin = rotary(x, pos)
        y = layer(x, attention_mask=_causal_mask(B, L), position_ids=pos, position_embeddings=cos_sin)
        y = y[0] if isinstance(y, tuple) else y
        normed = _rms(tensors[p + "final_layernorm.weight"], eps)(y)
        out.append(normed @ head.T)
        h = y if pre_norm else normed
    return out


# NextN families (``formats.Glm4Moe`` and its subclasses): transformers' classes per format.
NEXTN_CLASSES = {
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", "transformers.models.glm4_moe.modeling_glm4_moe",
                 "Glm4Moe"),
    "deepseek": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "transformers.models.deepseek_v3.modeling_deepseek_v3",
                 "DeepseekV3"),
}


def _nextn_class(fmt_name: str, what: str):
    import importlib

    config_cls, causal_cls, module, prefix = NEXTN_CLASSES[fmt_name]
    if what == "config":
        return getattr(importlib.import_module("transformers"), config_cls)
    if what == "causal_lm":
        return getattr(importlib.import_module("transformers"), causal_cls)
    return getattr(importlib.import_module(module), prefix + what)


def nextn_config(cfg: dict, fmt_name: str = "glm4_moe"):
    gcfg = _nextn_class(fmt_name, "config")(**{k: v for k, v in cfg.items() if k not in DROP})
    gcfg._attn_implementation = "eager"
    return gcfg


@torch.no_grad()
def nextn_backbone_hidden(out_dir: str, cfg: dict, tokens_BS: torch.Tensor,
                          fmt_name: str = "glm4_moe") -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' GLM-4.5 / DeepSeek-V3 model loaded from the written directory: (final hidden, logits)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the NextN layers are "unexpected" for the backbone class
    try:
        model = _nextn_class(fmt_name, "causal_lm").from_pretrained(
            out_dir, config=nextn_config(cfg, fmt_name), dtype=torch.float32).eval()
    finally:
        logging.set_verbosity(verbosity)
    hidden = model.model(tokens_BS).last_hidden_state
    return hidden, model.lm_head(hidden)


def _fused_experts(sd: dict, num_experts: int) -> dict:
    """Per-expert HF names -> transformers' in-memory ``experts.gate_up_proj`` / ``down_proj``."""
    gate_up, down = [], []
    for j in range(num_experts):
        gate_up.append(torch.cat([sd.pop(f"mlp.experts.{j}.gate_proj.weight"), sd.pop(f"mlp.experts.{j}.up_proj.weight")]))
        down.append(sd.pop(f"mlp.experts.{j}.down_proj.weight"))
    sd["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    sd["mlp.experts.down_proj"] = torch.stack(down)
    return sd


@torch.no_grad()
def nextn_draft_logits(tensors: dict, cfg: dict, hidden_BSH: torch.Tensor, tokens_BS: torch.Tensor, num_mtp: int,
                       emb=None, head=None, sglang_nextn: bool = False, fmt_name: str = "glm4_moe",
                       pre_norm: bool = False) -> list[torch.Tensor]:
    """GLM-4.5 / DeepSeek-V3 NextN chain: ``eh_proj(cat(enorm(emb), hnorm(h)))``, the family's MoE
    decoder layer (transformers' class: GQA for GLM-4.5, MLA for DeepSeek-V3), ``shared_head.norm``,
    ``shared_head.head``. ``emb``/``head``: the target's, for a draft that does not carry them
    (SGLang's NextN layout). The next step gets the ``shared_head.norm`` output (SGLang) or,
    with ``pre_norm``, the layer output before it (vLLM)."""
    gcfg = nextn_config(cfg, fmt_name)
    DecoderLayer, RMSNorm = _nextn_class(fmt_name, "DecoderLayer"), _nextn_class(fmt_name, "RMSNorm")
    eps, N = gcfg.rms_norm_eps, cfg["num_hidden_layers"]

    def norm(w):
        n = RMSNorm(w.shape[0], eps=eps)
        n.weight.data.copy_(w.float())
        return n

    rotary = _nextn_class(fmt_name, "RotaryEmbedding")(config=gcfg)
    B, S = tokens_BS.shape
    h = hidden_BSH.float()
    out = []
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    for k in range(1, num_mtp + 1):
        p = "model.layers.0." if sglang_nextn else f"model.layers.{N + k - 1}."
        E = tensors.get(p + "embed_tokens.weight", emb).float()
        W = tensors.get(p + "shared_head.head.weight", head).float()
        L = S - k
        e = F.embedding(tokens_BS[:, k:k + L], E)
        x = torch.cat([norm(tensors[p + "enorm.weight"])(e), norm(tensors[p + "hnorm.weight"])(h[:, :L])], dim=-1)
        x = x @ tensors[p + "eh_proj.weight"].float().T
        layer = DecoderLayer(gcfg, layer_idx=max(gcfg.first_k_dense_replace, N)).float().eval()
        sd = {n[len(p):]: v.float() for n, v in tensors.items() if n.startswith(p) and not n[len(p):].startswith(own)}
        layer.load_state_dict(_fused_experts(sd, gcfg.n_routed_experts), strict=True)
        pos = torch.arange(L).unsqueeze(0).expand(B, L)
        y = layer(x, attention_mask=_causal_mask(B, L), position_ids=pos, position_embeddings=rotary(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        normed = norm(tensors[p + "shared_head.norm.weight"])(y)
        out.append(normed @ W.T)
        h = y if pre_norm else normed
    return out


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """Max abs difference; raises when above ``tol`` times the reference's scale (>= 1)."""
    diff = (got.float() - ref.float()).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    if not diff <= tol * scale:
        raise ConvertError(f"verification failed: {name} differs from the independent forward by {diff:.3e} "
                           f"(tolerance {tol * scale:.1e})")
    return diff
