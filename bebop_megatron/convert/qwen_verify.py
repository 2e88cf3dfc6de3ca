"""``--verify`` for ``--format qwen3_next`` / ``qwen3_5``: an independent forward of the written files.

The backbone is transformers' model loaded from the written directory (full export). The
draft is written from the format description with transformers' own decoder layer,
zero-centred RMSNorm and rotary classes of the family, never Megatron's modules: MTP layer
``i`` maps the previous hidden state h and the next tokens' embeddings e to
``y = layer(mtp.fc(cat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h))))`` and
``mtp.norm(y)``, whose logits go through the target's ``lm_head``. Both engines run layer
``(k-1) % num_mtp_layers`` at draft step k and hand step k+1 the ``mtp.norm`` output.

:class:`QwenReference` has the interface of the other formats' references (constructor
``(tensors, cfg, num_layers, fmt_name, *, emb, head, sglang_nextn)``, ``step``, ``logits``) and
:func:`backbone_hidden` the backbone forwards' signature; both are registered in
``verify.REFERENCES`` / ``verify.BACKBONES`` under ``qwen3_5`` and ``qwen3_next``, so
``--verify`` runs them through the generic K-step :func:`bebop_megatron.convert.reference_chain.draft_chain`;
:func:`draft_logits` is that chain for these formats.

Legend: B batch, S sequence, L positions a step predicts (S - k), H hidden, V vocabulary.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from bebop_megatron.convert.reference_chain import causal_mask, fused_experts, draft_chain


MODULES = {"qwen3_next": ("qwen3_next", "Qwen3Next"), "qwen3_5_text": ("qwen3_5", "Qwen3_5"),
           "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5Moe")}


def config_objects(cfg: dict):
    """(the whole config, the language model's), transformers objects built from the written dict."""
    from transformers import CONFIG_MAPPING

    whole = CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in cfg.items()
                                                 if k not in ("model_type", "transformers_version")})
    text = getattr(whole, "text_config", None) or whole
    text._attn_implementation = "eager"
    return whole, text


def _cls(text, name: str):
    module, prefix = MODULES[text.model_type]
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), prefix + name)


class QwenReference:
    """Qwen3-Next / Qwen3.5 MTP layer ``i`` (``mtp.layers.{i}.*``; ``mtp.fc`` and the norms are shared)."""

    def __init__(self, tensors: dict, cfg: dict, num_layers: int, fmt_name: str = "qwen3_5", *, emb=None,
                 head=None, sglang_nextn: bool = False):
        _, self.text = config_objects(cfg)
        self.tensors, self.num_layers = tensors, num_layers
        # the target's embedding and head (a --mtp-only draft's copies exist for vLLM's loader only)
        self.emb, self.head = emb.float(), head.float()
        rotary = "RotaryEmbedding" if self.text.model_type == "qwen3_next" else "TextRotaryEmbedding"
        self.rotary = _cls(self.text, rotary)(config=self.text)
        self.layers = [self._layer(i) for i in range(num_layers)]

    def _layer(self, i: int):
        p = f"mtp.layers.{i}."
        layer = _cls(self.text, "DecoderLayer")(self.text, layer_idx=self.text.layer_types.index("full_attention"))
        sd = {k[len(p):]: v.float() for k, v in self.tensors.items() if k.startswith(p)}
        if "mlp.experts.0.gate_proj.weight" in sd:
            sd = fused_experts(sd, self.text.num_experts)
        layer.float().eval().load_state_dict(sd, strict=True)
        return layer

    def _norm(self, name: str):
        n = _cls(self.text, "RMSNorm")(self.text.hidden_size, eps=self.text.rms_norm_eps)
        n.weight.data.copy_(self.tensors[name].float())
        return n

    def step(self, i: int, h_BLH: torch.Tensor, tokens_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``i``: (its output before ``mtp.norm``, after it)."""
        e_BLH = F.embedding(tokens_BL, self.emb)
        x = torch.cat([self._norm("mtp.pre_fc_norm_embedding.weight")(e_BLH),
                       self._norm("mtp.pre_fc_norm_hidden.weight")(h_BLH)], dim=-1)
        x = x @ self.tensors["mtp.fc.weight"].float().T
        B, L = x.shape[:2]
        pos = torch.arange(L).unsqueeze(0).expand(B, L)
        y = self.layers[i](x, position_embeddings=self.rotary(x, pos), attention_mask=causal_mask(B, L),
                           position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return y, self._norm("mtp.norm.weight")(y)

    def logits(self, i: int, normed_BLH: torch.Tensor) -> torch.Tensor:
        return normed_BLH @ self.head.T


def draft_logits(tensors: dict, cfg: dict, hidden_BSH: torch.Tensor, tokens_BS: torch.Tensor, num_steps: int,
                 emb: torch.Tensor, head: torch.Tensor, handoff: str = "post_norm") -> list[torch.Tensor]:
    """Draft logits ``[B, S-k, V]`` of steps k = 1..num_steps through layer ``(k-1) % num_layers``
    (:class:`QwenReference` through :func:`bebop_megatron.convert.reference_chain.draft_chain`), handing
    on the ``mtp.norm`` output as both engines do (``pre_norm``: the output before it, a control)."""
    num_layers = len({k.split(".")[2] for k in tensors if k.startswith("mtp.layers.")})
    ref = QwenReference(tensors, cfg, num_layers, emb=emb, head=head)
    return draft_chain(ref, hidden_BSH, tokens_BS, num_steps, handoff)


@torch.no_grad()
def backbone_hidden(out_dir: str, tensors: dict, cfg: dict, tokens_BS: torch.Tensor,
                    fmt_name: str = "qwen3_5") -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' model loaded from the written directory: (final hidden [B,S,H], logits)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    whole, text = config_objects(cfg)
    multimodal = text is not whole
    cls = getattr(importlib.import_module("transformers"), cfg["architectures"][0]) if multimodal else AutoModelForCausalLM
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # mtp.* is "unexpected" for the backbone class
    try:
        model = cls.from_pretrained(out_dir, dtype=torch.float32).eval()
    finally:
        logging.set_verbosity(verbosity)
    base = model.model.language_model if multimodal else model.model
    hidden = base(input_ids=tokens_BS).last_hidden_state
    return hidden, model.lm_head(hidden)
