"""What MTP draft step k hands step k+1: in the trained Megatron chain, and in each engine.

``post_norm``: the MTP layer's output after its final norm (Megatron-Core's
``MultiTokenPredictionLayer``, the default ``mtp.next_step_input``); ``pre_norm``: before it.
Draft step 1 gets the target's last hidden state after its final norm, as Megatron trains it,
except in vLLM's MiMo path, whose target hands on the state before it (found by
``tools/serve_check.py``; see docs/conversion.md, "Serving the heads").

The engines (per format: ``engine_handoffs`` in :mod:`bebop_megatron.convert.formats`, the
first entry of each target being its default):
- SGLang, every family: post-norm.
- vLLM, every family: post-norm. Its DeepSeek-V3 / GLM-4.5 drafts (``deepseek_mtp.py``) do so
  since vLLM PR #45895 (merged 2026-06-19; #47448 did the same for the DeepSeek-V3.2 path);
  releases before it handed on the pre-norm state: ``--vllm-handoff pre_norm``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from bebop_megatron.convert.errors import ConvertError

HANDOFFS = ("post_norm", "pre_norm")
VLLM_LEGACY = "vLLM releases before PR #45895 (merged 2026-06-19)"
# A format without ``engine_handoffs`` runs post-norm in both engines (every format here declares its own).
DEFAULT_ENGINE_HANDOFFS = {"vllm": ("post_norm",), "sglang": ("post_norm",)}


def engine_handoffs(fmt) -> dict[str, tuple[str, ...]]:
    """Per target, the hand-offs the format's draft has run in that engine; the first is today's."""
    return getattr(fmt, "engine_handoffs", DEFAULT_ENGINE_HANDOFFS)


def describe(handoff: str) -> str:
    return "post-norm" if handoff == "post_norm" else "pre-norm"


def engine_handoff(fmt, target: str, vllm_handoff: str | None = None) -> str:
    """The hand-off the target engine runs for ``fmt``; ``vllm_handoff`` picks another one the
    format's vLLM draft has run (``pre_norm``: DeepSeek-V3 / GLM-4.5 before PR #45895)."""
    allowed = engine_handoffs(fmt)[target]
    if vllm_handoff is None:
        return allowed[0]
    if vllm_handoff not in HANDOFFS:
        raise ConvertError(f"unknown --vllm-handoff {vllm_handoff!r} (choose from {', '.join(HANDOFFS)})")
    if target != "vllm":
        raise ConvertError(f"--vllm-handoff applies to --target vllm only; {target} hands the next draft step "
                           f"the {describe(allowed[0])} state")
    if vllm_handoff not in allowed:
        raise ConvertError(f"--vllm-handoff {vllm_handoff}: vLLM's {fmt.name} draft hands the next step the "
                           f"{describe(allowed[0])} state in every release (pre_norm is for the DeepSeek-V3 / "
                           f"GLM-4.5 drafts of {VLLM_LEGACY})")
    return vllm_handoff


@dataclass(frozen=True)
class TrainedChain:
    """How the checkpoint's heads were trained: ``mtp.num_steps`` (None: not recorded) and
    ``mtp.next_step_input``; ``source`` names where it was read."""

    num_steps: int | None
    handoff: str
    source: str


def trained_chain(ckpt: str, common: dict | None) -> TrainedChain:
    """The ``mtp`` section of a training checkpoint's config (its common state), else of the
    ``bebop_model.yaml`` next to a model checkpoint (convert_from_hf); ``post_norm`` when unset."""
    from omegaconf import OmegaConf

    text, source = (common or {}).get("config_yaml"), "the training config"
    if not text:
        path = os.path.join(ckpt, "bebop_model.yaml")
        text, source = (open(path).read(), path) if os.path.isfile(path) else (None, "no recorded config")
    mtp = (OmegaConf.to_container(OmegaConf.create(text)) or {}).get("mtp", {}) if text else {}
    handoff = mtp.get("next_step_input", "post_norm")
    if handoff not in HANDOFFS:
        raise ConvertError(f"{source}: mtp.next_step_input={handoff!r} must be one of {', '.join(HANDOFFS)}")
    steps = mtp.get("num_steps")
    return TrainedChain(int(steps) if steps is not None else None, handoff, source)


def num_draft_steps(requested: int | None, trained: TrainedChain, num_mtp: int, verify: bool) -> int:
    """Draft steps K to verify and serve: ``--num-speculative-tokens``, else the trained
    ``mtp.num_steps``, else one per MTP layer."""
    K = requested if requested is not None else (trained.num_steps or num_mtp)
    if K < 1:
        raise ConvertError(f"--num-speculative-tokens {K} must be >= 1")
    if verify and num_mtp > 1 and K != num_mtp:
        raise ConvertError(f"--num-speculative-tokens {K}: the checkpoint has {num_mtp} MTP layers, which the "
                           f"Megatron model runs as exactly {num_mtp} steps (one layer is reused for any K); "
                           f"verify with {num_mtp} or pass --no-verify")
    return K


def mismatch_warning(fmt, trained: str, engine: str, target: str) -> str:
    """One line: the heads were trained with another hand-off than the engine runs."""
    fixes = [f"train with mtp.next_step_input={engine}"]
    if trained in engine_handoffs(fmt)["vllm"][1:]:
        fixes.insert(0, f"serve with {VLLM_LEGACY} and export with --vllm-handoff {trained}")
    elif target == "vllm" and trained == engine_handoffs(fmt)["vllm"][0]:
        fixes.insert(0, "serve with current vLLM (drop --vllm-handoff)")
    return (f"warning: the MTP heads were trained with mtp.next_step_input={trained}, but {target} hands the next "
            f"draft step the {describe(engine)} state: acceptance from draft step 2 on can be lower than training "
            f"measured, and --verify fails there; {', or '.join(fixes)}")
