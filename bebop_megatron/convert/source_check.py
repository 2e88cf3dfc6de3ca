"""The export's inputs and output (``tools/convert_to_hf.py``), checked before anything is loaded
or written.

- :func:`check_out_apart`: ``--out`` must not be, contain or lie inside an input directory
  (``--checkpoint``, ``--backbone``, ``--hf-dir``; the import's ``hf/`` lies inside its
  checkpoint): with ``--overwrite`` the export would replace the import's own ``config.json``.
- :func:`check_source`: the source ``config.json`` (``--hf-dir``, default the import's ``hf/``)
  gives the export its vocabulary, pad token and layer shapes; one of another model would cut
  the embedding to its vocabulary and still verify. It must describe the checkpoint's model:
  the ``model`` section the checkpoint records (a training run's config, or the import's
  ``bebop_model.yaml``), the stored embedding's shape, and the import's own ``hf/config.json``.
"""

from __future__ import annotations

import os

from bebop_megatron.convert.errors import ConvertError

COMPARED = ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups")
"""``model`` fields (as :func:`bebop_megatron.convert.hf_config.model_overrides` derives them)
that a source config.json must share with the checkpoint's recorded model."""


def check_out_apart(out_dir: str, inputs: dict[str, str | None]) -> None:
    """Raise when ``out_dir`` is, contains or lies inside one of ``inputs`` (flag -> path)."""
    out = os.path.realpath(out_dir)
    for flag, path in inputs.items():
        if not path:
            continue
        real = os.path.realpath(path)
        if out == real:
            where = "is"
        elif out.startswith(real.rstrip(os.sep) + os.sep):
            where = "lies inside"
        elif real.startswith(out.rstrip(os.sep) + os.sep):
            where = "contains"
        else:
            continue
        raise ConvertError(f"--out {out_dir} {where} the input {flag} {path}; write the export to a directory "
                           "apart from its inputs")


def recorded_model(ckpt: str, common: dict | None, backbone: str) -> tuple[dict, str]:
    """The ``model`` section the checkpoint records and where it was read: a training run's
    config (its common state), else the ``bebop_model.yaml`` of the import (``backbone``, then
    ``ckpt``); ``({}, "")`` when neither records one."""
    from omegaconf import OmegaConf

    text = (common or {}).get("config_yaml")
    if text:
        return (OmegaConf.to_container(OmegaConf.create(text)) or {}).get("model") or {}, f"{ckpt} (training config)"
    for directory in (backbone, ckpt):
        path = os.path.join(directory, "bebop_model.yaml")
        if os.path.isfile(path):
            return (OmegaConf.to_container(OmegaConf.load(path)) or {}).get("model") or {}, path
    return {}, ""


def check_source(source: str, explicit: bool, hf, stored_HV: tuple, recorded: tuple[dict, str],
                 import_config: str | None) -> None:
    """Raise one line naming every field in which the source config.json ``source`` (described
    as ``hf``) differs from the checkpoint: its recorded ``model`` section (``recorded``: fields,
    where), the stored embedding (``stored_HV``: rows, hidden size) and, for an ``explicit``
    ``--hf-dir``, the model type of the import's own ``hf/config.json`` (``import_config``)."""
    from bebop_megatron.convert.hf_config import model_overrides, read_config

    rows, hidden = stored_HV
    given = model_overrides(hf, rows, 1)
    fields, where = recorded
    diffs = [f"{name} {given[name]} (checkpoint: {fields[name]})" for name in COMPARED
             if fields.get(name) is not None and given.get(name) is not None and fields[name] != given[name]]
    if hidden != given["hidden_size"] and not any(d.startswith("hidden_size ") for d in diffs):
        diffs.append(f"hidden_size {given['hidden_size']} (checkpoint embedding: {hidden})")
    if rows < hf.vocab_size and not any(d.startswith("vocab_size ") for d in diffs):
        diffs.append(f"vocab_size {hf.vocab_size} (checkpoint embedding: {rows} rows)")
    if explicit and import_config and os.path.realpath(import_config) != os.path.realpath(
            os.path.join(source, "config.json")):
        theirs = read_config(os.path.dirname(import_config)).get("model_type")
        if theirs and hf.config.get("model_type") != theirs:
            diffs.append(f"model_type {hf.config.get('model_type')} ({import_config}: {theirs})")
    if diffs:
        flag = "--hf-dir " if explicit else ""
        records = f"; checkpoint model from {where}" if where else ""
        raise ConvertError(f"{flag}{source}/config.json does not describe the checkpoint's model: {'; '.join(diffs)}"
                           f"{records}; pass the config.json and tokenizer of the model the checkpoint was imported "
                           "from")
