"""Export only heads with the backbone they were trained on (``tools/convert_to_hf.py --backbone``).

A training checkpoint records its backbone's path and fingerprint
(:mod:`bebop_megatron.training.fingerprint`, ``common["backbone"]``). The given ``--backbone``
must match both; ``--allow-moved-backbone`` (a backbone moved or copied elsewhere) checks the
fingerprint alone. Checkpoints written before the record existed get a warning, not a refusal.
"""

from __future__ import annotations

import os

from bebop_megatron.convert.errors import ConvertError


def check_backbone(common: dict | None, ckpt: str, backbone: str, allow_moved: bool, log) -> None:
    """Raise :class:`ConvertError` (one line naming both) when ``backbone`` is not the one the
    training checkpoint ``ckpt`` (common state ``common``; None for a model checkpoint) recorded."""
    from bebop_megatron.training.fingerprint import fingerprint, short

    if not common or "config_yaml" not in common:
        return  # a model checkpoint (convert_from_hf, save_model_checkpoint): nothing was trained on it
    record = common.get("backbone")
    if record is None:
        log(f"warning: {ckpt} records no backbone fingerprint (written before they were recorded): cannot check "
            f"that --backbone {backbone} is the backbone its MTP heads were trained on ({_saved_path(common)})")
        return
    if record["path"] is None:
        raise ConvertError(f"{ckpt} was trained on a randomly initialised backbone (train.seed={record.get('seed')}), "
                           f"not on --backbone {backbone}: its MTP heads fit no saved model")
    try:
        given = fingerprint(backbone)
    except (OSError, ValueError) as err:
        raise ConvertError(f"--backbone {backbone}: cannot read its checkpoint metadata ({err})") from None
    recorded = record.get("fingerprint")
    if recorded is not None and given != recorded:
        raise ConvertError(f"--backbone {backbone} is not the backbone {ckpt} was trained on ({record['path']}): "
                           f"its weights differ (fingerprint {short(given)}, trained on {short(recorded)}); pass "
                           "the run's model.backbone_checkpoint")
    same_path = os.path.realpath(backbone) == record["realpath"]
    if not same_path and not allow_moved:
        raise ConvertError(f"--backbone {backbone} is not the backbone {ckpt} was trained on ({record['path']}); if "
                           "that backbone was moved or copied here, pass --allow-moved-backbone (its fingerprint is "
                           "still checked)")
    if recorded is None:  # it could not be read when the run started (and then failed to load)
        log(f"warning: {ckpt} holds no fingerprint of its backbone {record['path']}: "
            + ("only the path was compared" if same_path else "--backbone could not be checked"))
    elif not same_path:
        log(f"backbone: {backbone} has the fingerprint of {record['path']}, which the heads were trained on")


def _saved_path(common: dict) -> str:
    from omegaconf import OmegaConf

    model = OmegaConf.create(common["config_yaml"]).get("model", {})
    path = model.get("backbone_checkpoint") or model.get("init_checkpoint")
    return f"model.backbone_checkpoint={path}" if path else "a randomly initialised backbone"
