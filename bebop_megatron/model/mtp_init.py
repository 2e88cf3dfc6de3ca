"""How fresh MTP layers start (``mtp.init``), for a backbone that has none of its own.

A model imported without MTP layers gets one that must learn from nothing, and how it starts
decides how fast acceptance climbs (DESIGN.md, "Heads that start from nothing"):

- ``random``: Megatron's initialisation. The draft starts far from the backbone (alpha_RS near 0).
- ``copy_last_layer``: the MTP decoder layer and final norm are copies of the backbone's last
  layer and final norm (eh_proj, enorm, hnorm as Megatron initialises them). The draft
  starts confident and wrong: CE/KL spike, the TV gradient vanishes.
- ``identity``: the draft starts as the backbone's own next-token distribution one
  position early (measured to start *below* Megatron's init on on-policy data, whose
  consecutive next-token distributions overlap little, and to fall further under e2e TV): eh_proj passes the hidden half through (``[0 | I]``, Megatron concatenates
  ``[enorm(embedding), hnorm(hidden)]``), the layer's output projections (attention
  ``linear_proj``, MLP ``linear_fc2``) are zero so the residual layer is the identity, and the
  final norm is scaled by the RMS of the backbone's final-norm weight so that the logits keep
  the backbone's scale. The gradient reaches every parameter from the first step on
  (through the zero projections first), as in zero-initialised residual branches.

Applied on a fresh start only: a resumed run restores its MTP weights, and ``auto`` keeps the
MTP weights of ``model.init_checkpoint``. Every rank sets its own tensor-parallel shard.
"""

from __future__ import annotations

import torch

from bebop_megatron.config import Config, ConfigError

MTP_INITS = ("auto", "random", "copy_last_layer", "identity")
# ``auto`` over a pretrained backbone. Measured on Qwen2.5-Coder-1.5B-Instruct (benchmarks/real_model/
# RESULTS.md): after 4 e2e TV steps from each start, Megatron's init reached a held-out alpha_RS of
# 0.040 / 0.025 / 0.024 per step and ``identity`` 0.023 / 0.006 / 0.005; ``copy_last_layer`` stayed
# near 0.02 with a vanishing TV gradient in an earlier measurement. So ``auto`` keeps Megatron's.
AUTO_DEFAULT = "random"


def resolve(cfg: Config) -> str:
    """The init this run applies (``random`` = leave Megatron's, or the checkpoint's, weights).

    ``auto``: the MTP weights of ``model.init_checkpoint`` when given, otherwise
    ``AUTO_DEFAULT`` (Megatron's init, the measured best start)."""
    kind = cfg.mtp.init
    if kind == "auto":
        return "random" if cfg.model.init_checkpoint else AUTO_DEFAULT
    return kind


def _mtp_layers(model):
    mtp = getattr(model, "mtp", None)
    return list(mtp.layers) if mtp is not None else []


def _backbone_final_norm(model):
    decoder = getattr(model, "decoder", None)
    norm = getattr(decoder, "final_layernorm", None) if decoder is not None else None
    return getattr(norm, "weight", None)


@torch.no_grad()
def init_mtp_layers(model, kind: str, tp_rank: int) -> None:
    """Set this rank's MTP layers to ``kind`` (``random`` leaves them as they are)."""
    layers = _mtp_layers(model)
    if kind == "random" or not layers:
        return
    final_norm = _backbone_final_norm(model)
    if final_norm is None:
        raise ConfigError(f"mtp.init={kind} needs the backbone's final norm on the MTP stage; with a standalone "
                          f"MTP pipeline stage use mtp.init=random")
    if kind == "copy_last_layer":
        decoder_layers = list(model.decoder.layers)
        if not decoder_layers:
            raise ConfigError("mtp.init=copy_last_layer needs the last decoder layer on the MTP stage; with a "
                              "standalone MTP pipeline stage import with tools/convert_from_hf.py --mtp-init "
                              "copy_last_layer and pass model.init_checkpoint")
        # Hybrid models (Qwen3-Next / Qwen3.5): the MTP layer is full attention, so copy the last such layer.
        attention = [lay for lay in decoder_layers if type(lay.self_attention).__name__ != "GatedDeltaNet"]
        if not attention:
            raise ConfigError("mtp.init=copy_last_layer needs a full-attention decoder layer on the MTP stage")
        source = dict(attention[-1].named_parameters())
        for layer in layers:
            for name, param in layer.mtp_model_layer.named_parameters():
                param.copy_(source[name])
            layer.final_layernorm.weight.copy_(final_norm)
        return
    if kind != "identity":
        raise ConfigError(f"mtp.init={kind!r} must be one of {', '.join(MTP_INITS)}")
    # Zero-centred norms (Qwen3-Next / Qwen3.5) scale by 1 + w: the same effective scales, offset by one.
    offset = 1.0 if getattr(model.config, "layernorm_zero_centered_gamma", False) else 0.0
    scale = (final_norm.float() + offset).pow(2).mean().sqrt()
    for layer in layers:
        w = layer.eh_proj.weight  # [H / TP, 2H]: this rank's output rows of [enorm(emb), hnorm(h)] -> H
        rows, two_h = w.shape
        hidden = two_h // 2
        w.zero_()
        first = tp_rank * rows  # global output row of local row 0
        w[torch.arange(rows), hidden + first + torch.arange(rows)] = 1.0
        if getattr(layer.eh_proj, "bias", None) is not None:
            layer.eh_proj.bias.zero_()
        for name, param in layer.mtp_model_layer.named_parameters():
            if name.endswith(("linear_proj.weight", "linear_fc2.weight", "linear_proj.bias", "linear_fc2.bias")):
                param.zero_()
        layer.enorm.weight.fill_(1.0 - offset)
        layer.hnorm.weight.fill_(1.0 - offset)
        layer.final_layernorm.weight.fill_(scale.item() - offset)
