"""What an acceptance evaluation is asked for, checked before the model loads: the checkpoint's path,
the held-out data's kind, and :class:`EvalError`, the one-line error of a wrong flag, checkpoint or data.

Light on purpose (``os`` only): ``tools/eval_acceptance.py`` resolves ``--checkpoint`` with it before the
library (and torch) loads, so that a wrong path fails in a second.
"""

from __future__ import annotations

import os

SYNTHETIC = "synthetic"  # --data synthetic: held-out samples of the run's synthetic language


class EvalError(ValueError):
    """A wrong flag, checkpoint or data set: every rank finds it alike, so only rank 0 prints it
    (:func:`bebop_megatron.cli.run_cli`; a plain ``ValueError`` is printed by every rank)."""
    same_on_every_rank = True


def resolve_checkpoint(path: str) -> str:
    """A save.dir (its ``latest``) or one checkpoint directory; plain ``os`` checks, so a wrong
    path fails before the (slow) Megatron imports."""
    marker = os.path.join(path, "latest")  # training.checkpoint.LATEST
    if os.path.isfile(marker):
        with open(marker) as f:
            found = os.path.join(path, f.read().strip())
        if not os.path.isfile(os.path.join(found, "metadata.json")):
            raise EvalError(f"checkpoint not found: {marker} names {found}, which is not a complete checkpoint")
        return found
    if os.path.isfile(os.path.join(path, "bebop_model.yaml")):  # convert.importer's record of the sizes
        from bebop_megatron.config.checkpoints import import_given_as_training_checkpoint  # loads torch

        raise EvalError(import_given_as_training_checkpoint(path))
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    raise EvalError(f"checkpoint not found: {path} (expected a save.dir with 'latest' or an iter_N directory)")


def is_synthetic(args) -> bool:
    """``--data synthetic``: the run's synthetic language, not data files."""
    return list(args.data) == [SYNTHETIC]
