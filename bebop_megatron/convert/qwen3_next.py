"""``--format qwen3_next``: Qwen3-Next's MTP layout, as vLLM's ``Qwen3NextMTP`` and SGLang's
``Qwen3NextForCausalLMMTP`` load it (``qwen3_next_mtp.py`` in both engines).

Megatron MTP layer ``i`` -> ``mtp.fc.weight`` [H, 2H] (Megatron's ``eh_proj``: input
``cat(pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h))``, embedding first as in Megatron),
``mtp.pre_fc_norm_embedding.weight`` (``enorm``), ``mtp.pre_fc_norm_hidden.weight``
(``hnorm``), ``mtp.layers.{i}.*`` (the full-attention decoder layer with the family's names:
gated ``q_proj``, q/k norms, MoE with one tensor per expert, the shared expert and its gate)
and ``mtp.norm.weight`` (``final_layernorm``). All these norms are zero-centred on both sides.
The draft has no embedding or head of its own: both engines take the target's, but vLLM's
strict loader first wants ``model.embed_tokens.weight`` and ``lm_head.weight`` in the draft
directory, so ``--mtp-only`` writes them. Both engines reuse layer ``step % num_mtp_layers``
for every draft step and hand step k+1 the ``mtp.norm`` output (``post_norm``,
``engine_handoffs``); ``--verify`` chains ``--num-speculative-tokens`` steps through that layer.
"""

from __future__ import annotations

from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.layers import layer_to_hf, layer_to_megatron
from bebop_megatron.convert.serve import nextn_serve_command

# Megatron name (under mtp.layers.{i}.) -> HF name (under mtp.)
MTP_NAMES = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
             "eh_proj.weight": "fc.weight", "final_layernorm.weight": "norm.weight"}


def qwen_layer_shapes(text: dict, p: str, linear: bool, moe: bool, grouped: bool) -> dict[str, tuple]:
    """A Qwen3-Next / Qwen3.5 decoder layer as the engines load it, from the config alone."""
    H, nh, nkv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    d = text.get("head_dim") or H // nh
    out = {f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)}
    if linear:
        nk, dk = text["linear_num_key_heads"], text["linear_key_head_dim"]
        nv, dv = text["linear_num_value_heads"], text["linear_value_head_dim"]
        a = f"{p}linear_attn."
        if grouped:
            out.update({f"{a}in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, H), f"{a}in_proj_ba.weight": (2 * nv, H)})
        else:
            out.update({f"{a}in_proj_qkv.weight": (2 * nk * dk + nv * dv, H), f"{a}in_proj_z.weight": (nv * dv, H),
                        f"{a}in_proj_b.weight": (nv, H), f"{a}in_proj_a.weight": (nv, H)})
        out.update({f"{a}conv1d.weight": (2 * nk * dk + nv * dv, 1, text.get("linear_conv_kernel_dim", 4)),
                    f"{a}A_log": (nv,), f"{a}dt_bias": (nv,), f"{a}norm.weight": (dv,), f"{a}out_proj.weight": (H, nv * dv)})
    else:
        a = f"{p}self_attn."
        out.update({f"{a}q_proj.weight": (2 * nh * d, H), f"{a}k_proj.weight": (nkv * d, H),
                    f"{a}v_proj.weight": (nkv * d, H), f"{a}o_proj.weight": (H, nh * d),
                    f"{a}q_norm.weight": (d,), f"{a}k_norm.weight": (d,)})
    m = f"{p}mlp."
    if not moe:
        I = text["intermediate_size"]
        out.update({f"{m}gate_proj.weight": (I, H), f"{m}up_proj.weight": (I, H), f"{m}down_proj.weight": (H, I)})
        return out
    E, I, S = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
    out[f"{m}gate.weight"] = (E, H)
    for j in range(E):
        out.update({f"{m}experts.{j}.gate_proj.weight": (I, H), f"{m}experts.{j}.up_proj.weight": (I, H),
                    f"{m}experts.{j}.down_proj.weight": (H, I)})
    out.update({f"{m}shared_expert.gate_proj.weight": (S, H), f"{m}shared_expert.up_proj.weight": (S, H),
                f"{m}shared_expert.down_proj.weight": (H, S), f"{m}shared_expert_gate.weight": (1, H)})
    return out


class Qwen3Next:
    name = "qwen3_next"
    label = "Qwen3-Next"
    families = ("qwen3_next",)
    backbone_qkv_bias = None
    grouped = True  # in_proj_qkvz / in_proj_ba
    moe = True

    # What each engine's draft hands its next step (see convert/handoff.py): both engines'
    # qwen3_next_mtp.py / qwen3_5_mtp.py hand step k+1 the ``mtp.norm`` output.
    engine_handoffs = {"vllm": ("post_norm",), "sglang": ("post_norm",)}

    @staticmethod
    def text(cfg: dict) -> dict:
        return cfg

    @staticmethod
    def backbone_prefix(cfg: dict) -> str:
        return "model."

    @classmethod
    def check(cls, shape, family: str, num_mtp: int, target: str, mtp_only: bool) -> None:
        if family not in cls.families:
            raise ConvertError(f"--format {cls.name} needs a {cls.label} checkpoint; this checkpoint is {family}")
        if num_mtp > 1:
            raise ConvertError(f"--format {cls.name} holds one mtp.fc / mtp.norm for all its MTP layers; the "
                               f"checkpoint has {num_mtp} Megatron MTP layers (train with mtp.num_layers=1)")

    @staticmethod
    def prefix(i: int, num_layers: int = 0) -> str:
        return f"mtp.layers.{i}."

    @classmethod
    def to_megatron(cls, get, i: int, shape, num_layers: int) -> dict:
        meg = f"mtp.layers.{i}."
        out = {meg + m: get(f"mtp.{h}") for m, h in MTP_NAMES.items()} if i == 0 else {}
        out.update(layer_to_megatron(get, cls.prefix(i), f"{meg}mtp_model_layer.", shape))
        return out

    @classmethod
    def to_hf(cls, sd: dict, i: int, shape, num_layers: int, emb=None, head=None) -> dict:
        meg = f"mtp.layers.{i}."
        out = {f"mtp.{h}": sd[meg + m] for m, h in MTP_NAMES.items()} if i == 0 else {}
        out.update(layer_to_hf(sd, f"{meg}mtp_model_layer.", cls.prefix(i), shape))
        return out

    @classmethod
    def expected_mtp_shapes(cls, cfg: dict, i: int, target: str = "vllm", mtp_only: bool = False) -> dict:
        text = cls.text(cfg)
        H = text["hidden_size"]
        out = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
               "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)} if i == 0 else {}
        out.update(qwen_layer_shapes(text, cls.prefix(i), linear=False, moe=cls.is_moe(text), grouped=cls.grouped))
        return out

    @staticmethod
    def is_moe(text: dict) -> bool:
        return bool(text.get("num_experts"))

    @classmethod
    def writes_head(cls, cfg: dict) -> bool:
        """vLLM's Qwen3NextMTP always has its own ``lm_head`` to fill (the target's replaces it later)."""
        return True

    @classmethod
    def expected_shared_shapes(cls, cfg: dict) -> dict:
        """The embedding and head a ``--mtp-only`` draft carries for vLLM's strict loader."""
        text = cls.text(cfg)
        V, H = text["vocab_size"], text["hidden_size"]
        out = {f"{cls.backbone_prefix(cfg)}embed_tokens.weight": (V, H)}
        if cls.writes_head(cfg):
            out["lm_head.weight"] = (V, H)
        return out

    @classmethod
    def expected_backbone_shapes(cls, cfg: dict) -> dict:
        from bebop_megatron.convert.qwen_config import layer_types

        text, p = cls.text(cfg), cls.backbone_prefix(cfg)
        out = {**cls.expected_shared_shapes(cfg), f"{p}norm.weight": (text["hidden_size"],)}
        for i, kind in enumerate(layer_types(text)):
            out.update(qwen_layer_shapes(text, f"{p}layers.{i}.", linear=kind == "linear_attention",
                                         moe=cls.is_moe(text), grouped=cls.grouped))
        return out

    @classmethod
    def hf_config(cls, base: dict, num_mtp: int, target: str, mtp_only: bool) -> dict:
        cfg = dict(base)
        # vLLM's Qwen3NextMTP reads num_nextn_predict_layers; Qwen's own configs name it mtp_num_hidden_layers
        cfg.update(num_nextn_predict_layers=num_mtp, mtp_num_hidden_layers=num_mtp)
        return cfg

    @staticmethod
    def serve(out: str, target: str, mtp_only: bool, target_model: str, num_mtp: int, num_steps: int = 3) -> str:
        """Rejection sampling on: vLLM's probabilistic draft sampling, SGLang's flag (topk 1). Both
        engines reuse the one MTP layer for every one of the ``num_steps`` draft tokens."""
        return nextn_serve_command(out, target, mtp_only, target_model, num_steps)
