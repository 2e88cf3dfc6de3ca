"""``--verify``: reload the written files, check names and shapes, and recompute K draft steps
with an independent pure-PyTorch MTP forward written from the format description.

The reference uses transformers' own decoder-layer, RMSNorm and rotary classes for the
block and plain torch for the rest; it never touches Megatron modules. MTP step k at position
t combines the step k-1 hidden state at t (the backbone's, after its final norm, for k=1) with
the embedding of token t+k, through MTP layer ``(k-1) % num_layers`` (the engines'
``spec_step_idx % num_mtp_layers``: one layer reused for every step, or one per step), and
hands step k+1 what the target engine hands on (``handoff``: the layer's output after its
final norm, ``post_norm``, or before it, ``pre_norm``). (vLLM and SGLang also zero the
embedding at position 0; training does not, so neither does the comparison.)

A format plugs in with a reference class in ``REFERENCES`` (constructor
``(tensors, cfg, num_layers, fmt_name, *, emb, head, sglang_nextn)``, methods ``step`` and
``logits``, see :class:`MiMoReference`) and, for full exports, a backbone
forward in ``BACKBONES``; :func:`~bebop_megatron.convert.reference_chain.draft_chain` runs the K steps for every format alike.

Legend: B batch, S sequence, L positions a step predicts (S - k), H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bebop_megatron.convert import qwen_verify
from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.reference_chain import causal_mask, draft_chain, fused_experts

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


class MiMoReference:
    """MiMo MTP layer ``i``: ``input_proj(cat(hidden_layernorm(h), token_layernorm(emb)))``, a
    Qwen2 decoder layer, ``final_layernorm``; logits through ``lm_head``."""

    def __init__(self, tensors: dict, cfg: dict, num_layers: int, fmt_name: str = "mimo", *, emb=None, head=None,
                 sglang_nextn: bool = False):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

        self.tensors, self.num_layers, self.qcfg = tensors, num_layers, qwen2_config(cfg)
        self.emb = tensors["model.embed_tokens.weight"].float()
        self.head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).float()
        self.rotary = Qwen2RotaryEmbedding(config=self.qcfg)
        self.layers = [self._layer(i) for i in range(num_layers)]

    def _layer(self, i: int):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        p = f"model.mtp_layers.{i}."
        layer = Qwen2DecoderLayer(self.qcfg, layer_idx=0).float().eval()
        own = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")
        layer.load_state_dict({k[len(p):]: v.float() for k, v in self.tensors.items()
                               if k.startswith(p) and not k[len(p):].startswith(own)}, strict=True)
        return layer

    def step(self, i: int, h_BLH: torch.Tensor, tokens_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``i`` on the previous hidden state and the next tokens: (its output before
        ``final_layernorm``, after it)."""
        t, p, eps = self.tensors, f"model.mtp_layers.{i}.", self.qcfg.rms_norm_eps
        x = torch.cat([_rms(t[p + "hidden_layernorm.weight"], eps)(h_BLH),
                       _rms(t[p + "token_layernorm.weight"], eps)(_embed(self, tokens_BL, self.emb))], dim=-1)
        y = _decoder(self.layers[i], x @ t[p + "input_proj.weight"].float().T, self.rotary)
        return y, _rms(t[p + "final_layernorm.weight"], eps)(y)

    def logits(self, i: int, normed_BLH: torch.Tensor) -> torch.Tensor:
        return normed_BLH @ self.head.T


def _embed(ref, tokens_BL: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The draft's token embedding; zero at position 0 when ``ref.zero_first_embedding`` (as
    vLLM's MTP layers run; training and ``--verify`` do not)."""
    e_BLH = F.embedding(tokens_BL, weight)
    if getattr(ref, "zero_first_embedding", False):
        e_BLH = e_BLH.clone()
        e_BLH[:, 0] = 0
    return e_BLH


def _decoder(layer, x_BLH: torch.Tensor, rotary) -> torch.Tensor:
    B, L = x_BLH.shape[:2]
    pos = torch.arange(L).unsqueeze(0).expand(B, L)
    y = layer(x_BLH, attention_mask=causal_mask(B, L), position_ids=pos, position_embeddings=rotary(x_BLH, pos))
    return y[0] if isinstance(y, tuple) else y


def mimo_draft_logits(tensors: dict, cfg: dict, hidden_BSH: torch.Tensor, tokens_BS: torch.Tensor,
                      num_steps: int, handoff: str = "post_norm", num_layers: int = 1) -> list[torch.Tensor]:
    """The MiMo chain (:class:`MiMoReference` through :func:`draft_chain`)."""
    return draft_chain(MiMoReference(tensors, cfg, num_layers), hidden_BSH, tokens_BS, num_steps, handoff)


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


class NextNReference:
    """GLM-4.5 / DeepSeek-V3 NextN layer ``i``: ``eh_proj(cat(enorm(emb), hnorm(h)))``, the
    family's MoE decoder layer (transformers' class: GQA for GLM-4.5, MLA for DeepSeek-V3),
    ``shared_head.norm``; logits through ``shared_head.head``. ``emb``/``head``: the target's,
    for a draft that does not carry them (SGLang's NextN layout, ``model.layers.0``)."""

    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")

    def __init__(self, tensors: dict, cfg: dict, num_layers: int, fmt_name: str = "glm4_moe", *, emb=None,
                 head=None, sglang_nextn: bool = False):
        self.tensors, self.num_layers, self.fmt_name = tensors, num_layers, fmt_name
        self.gcfg = nextn_config(cfg, fmt_name)
        N = cfg["num_hidden_layers"]
        self.prefixes = ["model.layers.0." if sglang_nextn else f"model.layers.{N + i}." for i in range(num_layers)]
        self.emb = [self.tensors.get(p + "embed_tokens.weight", emb).float() for p in self.prefixes]
        self.head = [self.tensors.get(p + "shared_head.head.weight", head).float() for p in self.prefixes]
        self.rotary = _nextn_class(fmt_name, "RotaryEmbedding")(config=self.gcfg)
        self.layers = [self._layer(p, max(self.gcfg.first_k_dense_replace, N)) for p in self.prefixes]

    def _layer(self, p: str, layer_idx: int):
        layer = _nextn_class(self.fmt_name, "DecoderLayer")(self.gcfg, layer_idx=layer_idx).float().eval()
        sd = {n[len(p):]: v.float() for n, v in self.tensors.items()
              if n.startswith(p) and not n[len(p):].startswith(self.own)}
        layer.load_state_dict(fused_experts(sd, self.gcfg.n_routed_experts), strict=True)
        return layer

    def _norm(self, w: torch.Tensor):
        n = _nextn_class(self.fmt_name, "RMSNorm")(w.shape[0], eps=self.gcfg.rms_norm_eps)
        n.weight.data.copy_(w.float())
        return n

    def step(self, i: int, h_BLH: torch.Tensor, tokens_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NextN layer ``i``: (its output before ``shared_head.norm``, after it)."""
        t, p = self.tensors, self.prefixes[i]
        e_BLH = _embed(self, tokens_BL, self.emb[i])
        x = torch.cat([self._norm(t[p + "enorm.weight"])(e_BLH), self._norm(t[p + "hnorm.weight"])(h_BLH)], dim=-1)
        y = _decoder(self.layers[i], x @ t[p + "eh_proj.weight"].float().T, self.rotary)
        return y, self._norm(t[p + "shared_head.norm.weight"])(y)

    def logits(self, i: int, normed_BLH: torch.Tensor) -> torch.Tensor:
        return normed_BLH @ self.head[i].T


# Per format: the reference draft (see the module docstring) and the backbone forward on the
# written files, ``(out_dir, tensors, cfg, tokens_BS, fmt_name) -> (final hidden, logits)``.
REFERENCES = {"mimo": MiMoReference, "glm4_moe": NextNReference, "deepseek": NextNReference}
BACKBONES = {
    "mimo": lambda out_dir, tensors, cfg, tokens, fmt_name: mimo_backbone_hidden(tensors, cfg, tokens),
    "glm4_moe": lambda out_dir, tensors, cfg, tokens, fmt_name: nextn_backbone_hidden(out_dir, cfg, tokens, fmt_name),
    "deepseek": lambda out_dir, tensors, cfg, tokens, fmt_name: nextn_backbone_hidden(out_dir, cfg, tokens, fmt_name),
}


# Qwen3-Next / Qwen3.5 (``convert/qwen_verify.py``).

REFERENCES["qwen3_5"] = REFERENCES["qwen3_next"] = qwen_verify.QwenReference
BACKBONES["qwen3_5"] = BACKBONES["qwen3_next"] = qwen_verify.backbone_hidden


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float, hint: str = "") -> float:
    """Max abs difference; raises when above ``tol`` times the reference's scale (>= 1)."""
    diff = (got.float() - ref.float()).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    if not diff <= tol * scale:
        raise ConvertError(f"verification failed: {name}: max |difference| from the independent forward {diff:.3e} "
                           f"(tolerance {tol * scale:.1e}){hint}")
    return diff
