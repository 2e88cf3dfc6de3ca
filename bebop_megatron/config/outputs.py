"""The ``logging`` paths a run writes, checked at validation (they used to fail with a traceback
once the run had started): a file that is a directory, a directory that is a file, or a parent
path that runs through a file."""

from __future__ import annotations

import os

from bebop_megatron.config.errors import ConfigError


def _blocking_file(path: str) -> str | None:
    """The existing non-directory among ``path``'s parents (None: they are directories or absent)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return None if os.path.isdir(parent) else parent


def _check_file(path: str | None, name: str) -> None:
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{name}={path} is a directory; give a file path (the JSON lines are appended to it)")
    blocker = _blocking_file(path)
    if blocker:
        raise ConfigError(f"{name}={path}: {blocker} is a file, not a directory")


def _check_dir(path: str | None, name: str) -> None:
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{name}={path} is a file; give a directory (it is created if missing)")
    blocker = _blocking_file(path)
    if blocker:
        raise ConfigError(f"{name}={path}: {blocker} is a file, not a directory")


def validate_outputs(cfg) -> None:
    """``logging.metrics_file`` (a file), ``logging.tensorboard_dir`` and ``logging.wandb.dir``
    (directories)."""
    log = cfg.logging
    _check_file(log.metrics_file, "logging.metrics_file")
    _check_dir(log.tensorboard_dir, "logging.tensorboard_dir")
    _check_dir(log.wandb.dir, "logging.wandb.dir")
