"""Is a run's backbone still the one a training checkpoint was trained on?

Every checkpoint records its backbone's path and fingerprint (``common["backbone"]``,
:func:`bebop_megatron.training.fingerprint.backbone_record`). Files changed under the same
path (a backbone re-imported with other weights) are refused by resume
(:mod:`bebop_megatron.training.resume`) and by the evaluation tools, which load the trained
model with :func:`bebop_megatron.training.model_weights.load_trained_model`.
"""

from __future__ import annotations

from bebop_megatron.training.fingerprint import short


def backbone_change(saved: dict | None, current: dict) -> str | None:
    """How the backbone ``current`` (a ``backbone_record``) differs from ``saved``, the one a
    checkpoint was trained on: its files changed under the same path. None when they did not, or
    when either fingerprint is unknown (older checkpoints record none; an unreadable backbone
    fails when it is loaded). A moved or renamed path is a config change, compared elsewhere."""
    if not saved or not saved.get("fingerprint") or not current.get("fingerprint"):
        return None
    if saved.get("path") == current["path"] and saved["fingerprint"] != current["fingerprint"]:
        return (f"the backbone {current['path']} is not the one the checkpoint was trained on (its files changed: "
                f"fingerprint {short(current['fingerprint'])}, trained on {short(saved['fingerprint'])})")
    return None
