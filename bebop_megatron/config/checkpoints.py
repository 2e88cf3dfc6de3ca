"""``model.backbone_checkpoint`` / ``model.init_checkpoint`` of the wrong kind, named at validation.

Both load a model checkpoint (every backbone weight). Two directories look alike but are not
that, and used to fail after the model build with a ``KeyError`` or a 50-line
``CheckpointingException``:

- a training run's checkpoint (``iter_N``, with the ``config.yaml`` the trainer writes into it)
  or its ``save.dir``: it holds the MTP heads and the optimizer state, not the frozen backbone;
- an import of ``tools/convert_from_hf.py`` (``bebop_model.yaml`` beside its weights) used
  with other model sizes than the ones that file records.

Plain file checks (and a small YAML read): no torch, no Megatron.
"""

from __future__ import annotations

import os
import re

from bebop_megatron.config.errors import ConfigError

TRAINING_CONFIG = "config.yaml"  # training.checkpoint.CONFIG_FILE: in every checkpoint the trainer writes
LATEST = "latest"  # training.checkpoint.LATEST: in a training run's save.dir
IMPORT_RECORD = "bebop_model.yaml"  # convert.importer: the model/mtp sections of an imported model
_ITER = re.compile(r"^iter_\d+$")


def _is_training_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRAINING_CONFIG)) or (
        bool(_ITER.match(os.path.basename(os.path.normpath(path)))) and os.path.isfile(os.path.join(path, ".metadata")))


def _is_save_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, LATEST)) or any(
        _ITER.match(n) and os.path.isdir(os.path.join(path, n)) for n in os.listdir(path))


def _trained_on(path: str) -> str:
    """The backbone a training checkpoint names in its saved config ('' when unknown)."""
    from omegaconf import OmegaConf

    try:
        model = OmegaConf.to_container(OmegaConf.load(os.path.join(path, TRAINING_CONFIG))).get("model") or {}
    except Exception:  # an older checkpoint without config.yaml, or an unreadable one
        return ""
    backbone = model.get("backbone_checkpoint") or model.get("init_checkpoint")
    return f" (it was trained on {backbone})" if backbone else " (it was trained on a randomly initialised backbone)"


def _import_mismatches(path: str, cfg, name: str) -> list[str]:
    from omegaconf import OmegaConf

    try:
        record = OmegaConf.to_container(OmegaConf.load(os.path.join(path, IMPORT_RECORD)))
    except Exception as err:
        raise ConfigError(f"{name}={path}: cannot read its {IMPORT_RECORD} ({type(err).__name__})") from None
    sections = {"model": (record or {}).get("model") or {}}
    if name == "model.init_checkpoint":  # its MTP layers are loaded too
        sections["mtp"] = {k: v for k, v in ((record or {}).get("mtp") or {}).items() if k == "num_layers"}
    mismatches = []
    for section, values in sections.items():
        current = getattr(cfg, section)
        for key, value in values.items():
            if hasattr(current, key) and _effective(cfg, section, key) != value:
                mismatches.append(f"{section}.{key}={value} (this run: {_effective(cfg, section, key)})")
    return mismatches


def _effective(cfg, section: str, key: str):
    """The value the model is built with (null sizes are derived from the others)."""
    m, value = cfg.model, getattr(getattr(cfg, section), key)
    if section == "model" and value is None and key == "kv_channels" and m.num_attention_heads:
        return m.hidden_size // m.num_attention_heads
    if section == "model" and value is None and key == "padded_vocab_size":
        multiple = m.make_vocab_size_divisible_by * cfg.parallel.tensor
        return -(-m.vocab_size // multiple) * multiple
    return value


def _check(path: str | None, name: str, cfg) -> None:
    if not path or not os.path.isdir(path):
        return  # a missing directory is named when it is loaded
    if _is_training_checkpoint(path) or _is_save_dir(path):
        what = "a training checkpoint" if _is_training_checkpoint(path) else "a training run's save.dir"
        raise ConfigError(
            f"{name}={path} is {what}: it holds MTP heads and optimizer state, not the backbone's weights"
            f"{_trained_on(path) if what == 'a training checkpoint' else ''}; pass the backbone the run was "
            "trained on (a model checkpoint, e.g. from tools/convert_from_hf.py), or resume the run with its "
            "save.dir and train.resume=auto"
        )
    if os.path.isfile(os.path.join(path, IMPORT_RECORD)):
        mismatches = _import_mismatches(path, cfg, name)
        if mismatches:
            shown = ", ".join(mismatches[:4]) + (f" and {len(mismatches) - 4} more" if len(mismatches) > 4 else "")
            raise ConfigError(
                f"{name}={path} is a model imported by tools/convert_from_hf.py with other sizes than this run's: "
                f"{shown}; use the settings of {os.path.join(path, IMPORT_RECORD)} (copy its model/mtp sections "
                "into the run's config)"
            )


def import_given_as_training_checkpoint(path: str) -> str | None:
    """The one line for ``--checkpoint`` of the evaluation tools (eval_acceptance.py,
    speculative_generate.py) when ``path`` is a model imported by convert_from_hf.py, not a
    training checkpoint (they used to call it damaged); None otherwise."""
    if not os.path.isfile(os.path.join(path, IMPORT_RECORD)):
        return None
    return (f"--checkpoint {path} is a model imported by tools/convert_from_hf.py, not a training checkpoint: train "
            f"MTP heads on it (model.backbone_checkpoint={path}, or model.init_checkpoint to start from its MTP "
            f"layers, with the settings of its {IMPORT_RECORD}) and pass that run's save.dir")


def validate_checkpoints(cfg) -> None:
    """Refuse a training checkpoint (or save.dir) given as the model to load, and an import whose
    recorded sizes differ from ``cfg.model``."""
    _check(cfg.model.backbone_checkpoint, "model.backbone_checkpoint", cfg)
    _check(cfg.model.init_checkpoint, "model.init_checkpoint", cfg)
