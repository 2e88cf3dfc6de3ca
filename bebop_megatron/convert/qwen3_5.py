"""``--format qwen3_5``: Qwen3.5 (dense and MoE), as vLLM's ``Qwen3_5MTP`` / ``Qwen3_5MoeMTP`` and
SGLang's ``Qwen3_5ForCausalLMMTP`` load it (``qwen3_5_mtp.py`` in both engines).

The MTP names are Qwen3-Next's (``convert/qwen3_next.py``), top level ``mtp.*`` in both
layouts; the Gated DeltaNet layers store ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a``. The published checkpoints are ``Qwen3_5ForConditionalGeneration``: the backbone
under ``model.language_model.*``, ``lm_head.weight`` at the top, the config's language-model
part in ``text_config`` (``mtp_num_hidden_layers`` there) and a vision tower ``model.visual.*``,
which the import keeps aside (``hf/vision.safetensors``) and a full export writes back. A
text-only source (``Qwen3_5ForCausalLM``) exports with ``model.*`` names. vLLM's draft takes
``lm_head`` from the embedding when the model is tied, so a tied draft writes no ``lm_head``.
"""

from __future__ import annotations

import os

from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.qwen3_next import Qwen3Next

VISION_FILE = "vision.safetensors"  # next to the imported checkpoint's config.json (hf/)


class Qwen3_5(Qwen3Next):
    name = "qwen3_5"
    label = "Qwen3.5 (dense or MoE)"
    families = ("qwen3_5", "qwen3_5_moe")
    grouped = False

    @staticmethod
    def text(cfg: dict) -> dict:
        return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg

    @staticmethod
    def backbone_prefix(cfg: dict) -> str:
        return "model.language_model." if isinstance(cfg.get("text_config"), dict) else "model."

    @classmethod
    def writes_head(cls, cfg: dict) -> bool:
        return not cls.text(cfg).get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))

    @classmethod
    def hf_config(cls, base: dict, num_mtp: int, target: str, mtp_only: bool) -> dict:
        cfg = dict(base)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"] = {**cfg["text_config"], "mtp_num_hidden_layers": num_mtp}
        else:
            cfg["mtp_num_hidden_layers"] = num_mtp
        return cfg


def vision_tensors(hf_dir: str, cfg: dict) -> dict:
    """The vision tower a full export of the multimodal layout writes back (empty for text-only)."""
    if not isinstance(cfg.get("text_config"), dict) or "vision_config" not in cfg:
        return {}
    path = os.path.join(hf_dir, VISION_FILE)
    if not os.path.isfile(path):
        raise ConvertError(f"a full Qwen3_5ForConditionalGeneration export needs the vision tower: {path} is missing "
                           "(convert_from_hf.py writes it; or export --mtp-only)")
    from safetensors.torch import load_file

    return load_file(path)
