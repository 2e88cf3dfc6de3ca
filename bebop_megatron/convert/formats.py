"""One explicit MTP key map per export format (names as vLLM and SGLang load them).

See ``docs/FORMATS.md`` of the project notes. Megatron's MTP layer ``i`` holds ``enorm``,
``hnorm``, ``eh_proj`` (input ``cat(enorm(emb), hnorm(h))``, embedding first), the decoder
layer ``mtp_model_layer`` and ``final_layernorm``.
"""

from __future__ import annotations

import torch

from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.hf_config import LayerShape
from bebop_megatron.convert.layers import layer_to_hf, layer_to_megatron
from bebop_megatron.convert.qwen3_5 import Qwen3_5
from bebop_megatron.convert.qwen3_next import Qwen3Next
from bebop_megatron.convert.serve import nextn_serve_command

TARGETS = ("vllm", "sglang")


def meg_mtp(i: int) -> str:
    return f"mtp.layers.{i}."


def qwen2_layer_shapes(cfg: dict, p: str) -> dict[str, tuple]:
    """A Qwen2 decoder layer as vLLM/SGLang's ``Qwen2DecoderLayer`` loads it (qkv biases)."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = H // nh
    return {
        f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,),
        f"{p}self_attn.q_proj.weight": (nh * d, H), f"{p}self_attn.q_proj.bias": (nh * d,),
        f"{p}self_attn.k_proj.weight": (nkv * d, H), f"{p}self_attn.k_proj.bias": (nkv * d,),
        f"{p}self_attn.v_proj.weight": (nkv * d, H), f"{p}self_attn.v_proj.bias": (nkv * d,),
        f"{p}self_attn.o_proj.weight": (H, nh * d),
        f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H), f"{p}mlp.down_proj.weight": (H, I),
    }


class MiMo:
    """MiMo: ``model.mtp_layers.{i}.*`` (relative index), Qwen2 decoder layer, projection input
    ``cat(hidden_layernorm(h), token_layernorm(emb))`` (hidden first: halves swapped)."""

    name = "mimo"
    architecture = "MiMoForCausalLM"

    # What each engine's draft hands its next step (first: the default; see convert/handoff.py):
    # both engines' MiMo drafts hand on the ``final_layernorm`` output.
    engine_handoffs = {"vllm": ("post_norm",), "sglang": ("post_norm",)}
    model_type = "mimo"
    families = ("qwen2", "mimo", "llama")
    backbone_qkv_bias = True  # the engines' Qwen2 layers always have qkv biases (zeros if absent)

    @staticmethod
    def prefix(i: int, num_layers: int) -> str:
        return f"model.mtp_layers.{i}."

    @classmethod
    def check(cls, shape: LayerShape, family: str, num_mtp: int, target: str, mtp_only: bool) -> None:
        if family not in cls.families or shape.qk_norm or shape.num_experts:
            raise ConvertError(
                f"--format mimo needs a Qwen2-shaped dense model (families {', '.join(cls.families)}); "
                f"this checkpoint is {family}")
        if target == "sglang" and num_mtp > 1:
            raise ConvertError(f"SGLang's MiMoMTP loads one MTP layer; the checkpoint has {num_mtp} "
                               "(train with mtp.num_layers=1 or export --target vllm)")
        if target == "vllm" and num_mtp > 1:
            raise ConvertError(f"vLLM's MiMoMTP predicts with its first MTP layer only; the checkpoint has "
                               f"{num_mtp} (train with mtp.num_layers=1)")
        if target == "vllm" and mtp_only:
            raise ConvertError("--mtp-only: vLLM's MiMo draft reads num_nextn_predict_layers from the served model's "
                               "config (vllm/model_executor/models/mimo_mtp.py), so it cannot be served beside a plain "
                               "target; export the full model (without --mtp-only) and serve it alone")

    @classmethod
    def to_megatron(cls, get, i: int, shape: LayerShape, num_layers: int) -> dict:
        hf, meg = cls.prefix(i, num_layers), meg_mtp(i)
        w_h, w_e = torch.chunk(get(f"{hf}input_proj.weight"), 2, dim=1)
        out = {
            f"{meg}enorm.weight": get(f"{hf}token_layernorm.weight"),
            f"{meg}hnorm.weight": get(f"{hf}hidden_layernorm.weight"),
            f"{meg}eh_proj.weight": torch.cat([w_e, w_h], dim=1),
            f"{meg}final_layernorm.weight": get(f"{hf}final_layernorm.weight"),
        }
        out.update(layer_to_megatron(get, hf, f"{meg}mtp_model_layer.", shape))
        return out

    @classmethod
    def to_hf(cls, sd: dict, i: int, shape: LayerShape, num_layers: int, emb=None, head=None) -> dict:
        hf, meg = cls.prefix(i, num_layers), meg_mtp(i)
        w_e, w_h = torch.chunk(sd[f"{meg}eh_proj.weight"], 2, dim=1)
        out = {
            f"{hf}token_layernorm.weight": sd[f"{meg}enorm.weight"],
            f"{hf}hidden_layernorm.weight": sd[f"{meg}hnorm.weight"],
            f"{hf}input_proj.weight": torch.cat([w_h, w_e], dim=1),
            f"{hf}final_layernorm.weight": sd[f"{meg}final_layernorm.weight"],
        }
        out.update(layer_to_hf(sd, f"{meg}mtp_model_layer.", hf, shape, qkv_bias=True))
        return out

    @classmethod
    def expected_mtp_shapes(cls, cfg: dict, i: int, target: str = "vllm", mtp_only: bool = False) -> dict[str, tuple]:
        """Written from the engines' MiMo layer (Qwen2 decoder layer), independent of the map."""
        H = cfg["hidden_size"]
        p = cls.prefix(i, cfg["num_hidden_layers"])
        return {
            f"{p}token_layernorm.weight": (H,), f"{p}hidden_layernorm.weight": (H,),
            f"{p}input_proj.weight": (H, 2 * H), f"{p}final_layernorm.weight": (H,),
            **qwen2_layer_shapes(cfg, p),
        }

    @classmethod
    def expected_backbone_shapes(cls, cfg: dict) -> dict[str, tuple]:
        H, V = cfg["hidden_size"], cfg["vocab_size"]
        # lm_head even when tied: vLLM's MiMoMTP draft checks that it was loaded
        out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
        for i in range(cfg["num_hidden_layers"]):
            out.update(qwen2_layer_shapes(cfg, f"model.layers.{i}."))
        return out

    @classmethod
    def hf_config(cls, base: dict, num_mtp: int, target: str, mtp_only: bool) -> dict:
        cfg = dict(base)
        cfg.update(architectures=[cls.architecture], model_type=cls.model_type, num_nextn_predict_layers=num_mtp,
                   auto_map={"AutoConfig": "configuration_mimo.MiMoConfig"})
        # MiMo's decoder is Qwen2's: head_dim = hidden / heads and qkv biases (zero if absent).
        if cfg.get("head_dim") not in (None, cfg["hidden_size"] // cfg["num_attention_heads"]):
            raise ConvertError("--format mimo needs head_dim == hidden_size / num_attention_heads")
        cfg.pop("head_dim", None)
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            cfg.pop(key, None)
        return cfg

    # transformers has no "mimo" model type; engines load the config with --trust-remote-code
    # from this file, as the published MiMo checkpoints ship it.
    extra_files = {"configuration_mimo.py": (
        "from transformers import Qwen2Config\n\n\n"
        "class MiMoConfig(Qwen2Config):\n"
        "    model_type = \"mimo\"\n\n"
        "    def __init__(self, *args, num_nextn_predict_layers=0, **kwargs):\n"
        "        self.num_nextn_predict_layers = num_nextn_predict_layers\n"
        "        super().__init__(*args, **kwargs)\n")}

    @staticmethod
    def serve(out: str, target: str, mtp_only: bool, target_model: str, num_mtp: int, num_steps: int = 3) -> str:
        if target == "vllm":  # a full export: vLLM's MiMo draft comes from the served model itself
            return (f"vllm serve {target_model} --trust-remote-code --speculative-config "
                    f"'{{\"method\": \"mtp\", \"num_speculative_tokens\": {num_steps}, "
                    f"\"draft_sample_method\": \"probabilistic\"}}'")
        return (f"python -m sglang.launch_server --model-path {target_model} --trust-remote-code "
                f"--speculative-algorithm NEXTN --speculative-draft-model-path {out} "
                f"--speculative-num-steps {num_steps} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {num_steps + 1} --speculative-use-rejection-sampling")


def glm_layer_shapes(cfg: dict, p: str, moe: bool) -> dict[str, tuple]:
    """A GLM-4.5 decoder layer as vLLM/SGLang's ``Glm4MoeDecoderLayer`` loads it."""
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or H // nh
    out = {
        f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,),
        f"{p}self_attn.q_proj.weight": (nh * d, H), f"{p}self_attn.k_proj.weight": (nkv * d, H),
        f"{p}self_attn.v_proj.weight": (nkv * d, H), f"{p}self_attn.o_proj.weight": (H, nh * d),
    }
    if cfg.get("attention_bias"):
        out.update({f"{p}self_attn.q_proj.bias": (nh * d,), f"{p}self_attn.k_proj.bias": (nkv * d,),
                    f"{p}self_attn.v_proj.bias": (nkv * d,)})
    if cfg.get("use_qk_norm"):
        out.update({f"{p}self_attn.q_norm.weight": (d,), f"{p}self_attn.k_norm.weight": (d,)})
    out.update(moe_mlp_shapes(cfg, p, moe))
    return out


def deepseek_layer_shapes(cfg: dict, p: str, moe: bool) -> dict[str, tuple]:
    """A DeepSeek-V3 decoder layer (MLA) as vLLM/SGLang's ``DeepseekV2DecoderLayer`` loads it."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    r_q, r_kv = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    a = f"{p}self_attn."
    out = {f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)}
    if r_q is None:
        out[f"{a}q_proj.weight"] = (nh * qk, H)
    else:
        out.update({f"{a}q_a_proj.weight": (r_q, H), f"{a}q_a_layernorm.weight": (r_q,),
                    f"{a}q_b_proj.weight": (nh * qk, r_q)})
    out.update({
        f"{a}kv_a_proj_with_mqa.weight": (r_kv + cfg["qk_rope_head_dim"], H), f"{a}kv_a_layernorm.weight": (r_kv,),
        f"{a}kv_b_proj.weight": (nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), r_kv),
        f"{a}o_proj.weight": (H, nh * cfg["v_head_dim"]),
    })
    out.update(moe_mlp_shapes(cfg, p, moe))
    return out


def moe_mlp_shapes(cfg: dict, p: str, moe: bool) -> dict[str, tuple]:
    """The MLP of a GLM-4.5 / DeepSeek-V3 layer: dense, or routed experts + shared experts."""
    H = cfg["hidden_size"]
    out = {}
    if not moe:
        I = cfg["intermediate_size"]
        out.update({f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H),
                    f"{p}mlp.down_proj.weight": (H, I)})
        return out
    E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out.update({f"{p}mlp.gate.weight": (E, H), f"{p}mlp.gate.e_score_correction_bias": (E,)})
    for j in range(E):
        out.update({f"{p}mlp.experts.{j}.gate_proj.weight": (I, H), f"{p}mlp.experts.{j}.up_proj.weight": (I, H),
                    f"{p}mlp.experts.{j}.down_proj.weight": (H, I)})
    S = I * cfg.get("n_shared_experts", 0)
    if S:
        out.update({f"{p}mlp.shared_experts.gate_proj.weight": (S, H), f"{p}mlp.shared_experts.up_proj.weight": (S, H),
                    f"{p}mlp.shared_experts.down_proj.weight": (H, S)})
    return out


class Glm4Moe:
    """GLM-4.5 (DeepSeek-style NextN names): ``model.layers.{N+i}.{enorm,hnorm,eh_proj}``,
    ``shared_head.{norm,head}``, ``embed_tokens`` and the (MoE) decoder layer; projection
    input ``cat(enorm(emb), hnorm(h))`` as in Megatron. SGLang's separate NextN checkpoint:
    one layer renamed ``model.layers.0.*`` without embedding and head, ``num_hidden_layers: 1``."""

    name = "glm4_moe"
    label = "a GLM-4.5 MoE"

    # SGLang's NextN model hands on the ``shared_head.norm`` output; so does vLLM's
    # ``deepseek_mtp.py`` since PR #45895 (merged 2026-06-19); its releases before that handed
    # on the layer output before the norm (``--vllm-handoff pre_norm``).
    engine_handoffs = {"vllm": ("post_norm", "pre_norm"), "sglang": ("post_norm",)}
    architecture = "Glm4MoeForCausalLM"
    nextn_architecture = "Glm4MoeForCausalLMNextN"
    families = ("glm4_moe",)
    backbone_qkv_bias = None  # as the model has them
    layer_shapes = staticmethod(glm_layer_shapes)

    @staticmethod
    def prefix(i: int, num_layers: int, sglang_nextn: bool = False) -> str:
        return "model.layers.0." if sglang_nextn else f"model.layers.{num_layers + i}."

    @classmethod
    def check(cls, shape: LayerShape, family: str, num_mtp: int, target: str, mtp_only: bool) -> None:
        if family not in cls.families:
            raise ConvertError(f"--format {cls.name} needs {cls.label} checkpoint; this checkpoint is {family}")
        if target == "sglang" and num_mtp > 1:
            raise ConvertError(f"SGLang loads one NextN layer; the checkpoint has {num_mtp} "
                               "(train with mtp.num_layers=1 or export --target vllm)")

    @classmethod
    def to_megatron(cls, get, i: int, shape: LayerShape, num_layers: int) -> dict:
        hf, meg = cls.prefix(i, num_layers), meg_mtp(i)
        for copy in ("embed_tokens.weight", "shared_head.head.weight"):  # copies of the shared ones
            get(f"{hf}{copy}")
        out = {
            f"{meg}enorm.weight": get(f"{hf}enorm.weight"),
            f"{meg}hnorm.weight": get(f"{hf}hnorm.weight"),
            f"{meg}eh_proj.weight": get(f"{hf}eh_proj.weight"),
            f"{meg}final_layernorm.weight": get(f"{hf}shared_head.norm.weight"),
        }
        out.update(layer_to_megatron(get, hf, f"{meg}mtp_model_layer.", shape))
        return out

    @classmethod
    def to_hf(cls, sd: dict, i: int, shape: LayerShape, num_layers: int, emb=None, head=None,
              sglang_nextn: bool = False) -> dict:
        hf, meg = cls.prefix(i, num_layers, sglang_nextn), meg_mtp(i)
        out = {
            f"{hf}enorm.weight": sd[f"{meg}enorm.weight"],
            f"{hf}hnorm.weight": sd[f"{meg}hnorm.weight"],
            f"{hf}eh_proj.weight": sd[f"{meg}eh_proj.weight"],
            f"{hf}shared_head.norm.weight": sd[f"{meg}final_layernorm.weight"],
        }
        if not sglang_nextn:  # vLLM's strict loader wants every layer's head and the embedding
            out[f"{hf}shared_head.head.weight"] = head
            out[f"{hf}embed_tokens.weight"] = emb
        out.update(layer_to_hf(sd, f"{meg}mtp_model_layer.", hf, shape))
        return out

    @classmethod
    def expected_mtp_shapes(cls, cfg: dict, i: int, target: str = "vllm", mtp_only: bool = False) -> dict[str, tuple]:
        H, V = cfg["hidden_size"], cfg["vocab_size"]
        nextn = target == "sglang" and mtp_only
        p = cls.prefix(i, cfg["num_hidden_layers"], nextn)
        out = {f"{p}enorm.weight": (H,), f"{p}hnorm.weight": (H,), f"{p}eh_proj.weight": (H, 2 * H),
               f"{p}shared_head.norm.weight": (H,), **cls.layer_shapes(cfg, p, moe=True)}
        if not nextn:
            out.update({f"{p}shared_head.head.weight": (V, H), f"{p}embed_tokens.weight": (V, H)})
        return out

    @classmethod
    def expected_backbone_shapes(cls, cfg: dict) -> dict[str, tuple]:
        H, V = cfg["hidden_size"], cfg["vocab_size"]
        out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
        if not cfg.get("tie_word_embeddings", False):
            out["lm_head.weight"] = (V, H)
        for i in range(cfg["num_hidden_layers"]):
            out.update(cls.layer_shapes(cfg, f"model.layers.{i}.", moe=i >= cfg.get("first_k_dense_replace", 0)))
        return out

    @classmethod
    def hf_config(cls, base: dict, num_mtp: int, target: str, mtp_only: bool) -> dict:
        cfg = dict(base)
        cfg.update(architectures=[cls.architecture], num_nextn_predict_layers=num_mtp)
        if target == "sglang" and mtp_only:
            cfg.update(architectures=[cls.nextn_architecture], num_hidden_layers=1)
        return cfg

    @staticmethod
    def serve(out: str, target: str, mtp_only: bool, target_model: str, num_mtp: int, num_steps: int = 3) -> str:
        return nextn_serve_command(out, target, mtp_only, target_model, num_steps)


class DeepSeek(Glm4Moe):
    """DeepSeek-V3 NextN: the GLM-4.5 layout above (GLM-4.5 took it from DeepSeek) with MLA
    attention names in the decoder layer. vLLM: ``DeepSeekMTP`` (absolute indices, head and
    embedding copies); SGLang: ``DeepseekV3ForCausalLMNextN`` (``model.layers.0.*``)."""

    name = "deepseek"
    label = "a DeepSeek-V3"
    architecture = "DeepseekV3ForCausalLM"
    nextn_architecture = "DeepseekV3ForCausalLMNextN"
    families = ("deepseek_v3",)
    layer_shapes = staticmethod(deepseek_layer_shapes)

    @classmethod
    def hf_config(cls, base: dict, num_mtp: int, target: str, mtp_only: bool) -> dict:
        cfg = super().hf_config(base, num_mtp, target, mtp_only)
        # The engines' DeepSeek MoE reads the router kind from these (the published config.json
        # has them; transformers' DeepseekV3Config does not write them): sigmoid scores with
        # e_score_correction_bias, as the Megatron model computes.
        cfg.setdefault("scoring_func", "sigmoid")
        cfg.setdefault("topk_method", "noaux_tc")
        return cfg


FORMATS = {"mimo": MiMo, "glm4_moe": Glm4Moe, "deepseek": DeepSeek, "qwen3_next": Qwen3Next, "qwen3_5": Qwen3_5}
# The format whose names an HF checkpoint of a family stores its MTP layers in (import).
IMPORT_FORMAT = {"mimo": MiMo, "glm4_moe": Glm4Moe, "deepseek_v3": DeepSeek, "qwen3_next": Qwen3Next,
                 "qwen3_5": Qwen3_5, "qwen3_5_moe": Qwen3_5}
# Formats named in the issue but not implemented yet: refused with this reason.
PLANNED: dict[str, str] = {}


def get_format(name: str):
    if name in PLANNED:
        raise ConvertError(f"--format {name} is not supported yet: {PLANNED[name]}")
    if name not in FORMATS:
        raise ConvertError(f"unknown --format {name!r} (choose from {', '.join([*FORMATS, *PLANNED])})")
    return FORMATS[name]
