"""``--verify`` for ``--format qwen3_next`` / ``qwen3_5``: an independent forward of the written files.

The backbone is transformers' model loaded from the written directory (full export). The
draft chain is written from the format description with transformers' own decoder layer,
zero-centred RMSNorm and rotary classes of the family, never Megatron's modules: step k at
position t takes the step k-1 hidden state at t (the backbone's after its final norm for
k=1) and the embedding of token t+k,
``h_k = mtp.norm(layer(mtp.fc(cat(pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h_{k-1})))))``,
logits ``h_k @ lm_head``; the MTP layer ``(k-1) % num_mtp_layers`` is reused for every step and
the ``mtp.norm`` output is handed on (``post_norm``), as both engines' drafts do.

Legend: B batch, S sequence, H hidden, V vocabulary.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from bebop_megatron.convert.verify import _causal_mask, _fused_experts

MODULES = {"qwen3_next": ("qwen3_next", "Qwen3Next"), "qwen3_5_text": ("qwen3_5", "Qwen3_5"),
           "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5Moe")}


def text_config(out_dir: str):
    """The language model's config object, from the written config.json (eager attention)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(out_dir)
    text = getattr(cfg, "text_config", None) or cfg
    text._attn_implementation = "eager"
    return cfg, text


def _cls(text, name: str):
    module, prefix = MODULES[text.model_type]
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), prefix + name)


@torch.no_grad()
def backbone_hidden(out_dir: str, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' model loaded from the written directory: (final hidden [B,S,H], logits)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    cfg, text = text_config(out_dir)
    multimodal = text is not cfg
    if multimodal:
        cls = getattr(importlib.import_module("transformers"), cfg.architectures[0])
    else:
        cls = AutoModelForCausalLM
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # mtp.* is "unexpected" for the backbone class
    try:
        model = cls.from_pretrained(out_dir, config=cfg, dtype=torch.float32).eval()
    finally:
        logging.set_verbosity(verbosity)
    base = model.model.language_model if multimodal else model.model
    hidden = base(input_ids=tokens_BS).last_hidden_state
    return hidden, model.lm_head(hidden)


@torch.no_grad()
def draft_logits(tensors: dict, out_dir: str, hidden_BSH: torch.Tensor, tokens_BS: torch.Tensor, num_steps: int,
                 emb: torch.Tensor, head: torch.Tensor, pre_norm: bool = False) -> list[torch.Tensor]:
    """Draft logits ``[B, S-k, V]`` of steps k = 1..num_steps. ``emb``/``head``: the target's (the
    draft files may not carry them). ``pre_norm`` hands on the layer output before ``mtp.norm``
    (no engine does for this family; kept for symmetry with the other formats' references)."""
    _, text = text_config(out_dir)
    norm_cls, rotary = _cls(text, "RMSNorm"), _cls(text, "TextRotaryEmbedding" if text.model_type != "qwen3_next"
                                                  else "RotaryEmbedding")(config=text)

    def norm(name):
        n = norm_cls(text.hidden_size, eps=text.rms_norm_eps)
        n.weight.data.copy_(tensors[name].float())
        return n

    num_layers = len({k.split(".")[2] for k in tensors if k.startswith("mtp.layers.")})
    layers = []
    for i in range(num_layers):
        p = f"mtp.layers.{i}."
        layer = _cls(text, "DecoderLayer")(text, layer_idx=text.layer_types.index("full_attention")).float().eval()
        sd = {k[len(p):]: v.float() for k, v in tensors.items() if k.startswith(p)}
        layer.load_state_dict(_fused_experts(sd, getattr(text, "num_experts", 0) or 0) if "mlp.experts.0.gate_proj.weight"
                              in sd else sd, strict=True)
        layers.append(layer)
    B, S = tokens_BS.shape
    h = hidden_BSH.float()
    fc = tensors["mtp.fc.weight"].float()
    out = []
    for k in range(1, num_steps + 1):
        L = S - k
        e = F.embedding(tokens_BS[:, k:k + L], emb.float())
        x = torch.cat([norm("mtp.pre_fc_norm_embedding.weight")(e), norm("mtp.pre_fc_norm_hidden.weight")(h[:, :L])],
                      dim=-1) @ fc.T
        pos = torch.arange(L).unsqueeze(0).expand(B, L)
        y = layers[(k - 1) % num_layers](x, position_embeddings=rotary(x, pos), attention_mask=_causal_mask(B, L),
                                         position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        normed = norm("mtp.norm.weight")(y)
        out.append(normed @ head.float().T)
        h = y if pre_norm else normed
    return out
