"""Model weights as Megatron distributed checkpoints: all weights of a model
(:func:`save_model_checkpoint`; ``model.init_checkpoint`` / ``model.backbone_checkpoint`` load
them), the backbone or MTP part of one, and the trained model of a training checkpoint
(:func:`load_trained_model`). Any saved layout loads at the model's layout.

The training checkpoints (MTP weights, optimizer, RNG, ``latest``) are
:mod:`bebop_megatron.training.checkpoint`.
"""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist
from megatron.core import dist_checkpointing

from bebop_megatron.model import is_mtp_param


class BackboneChanged(ValueError):
    """The backbone's files changed since the checkpoint was trained on them; every rank finds it
    alike (:func:`bebop_megatron.cli.run_cli` prints it once)."""

    same_on_every_rank = True


def use_in_process_write_results() -> None:
    """Collect writer results in a plain queue instead of a spawned ``Manager`` process.

    Megatron's file writer reports results through a process-shared queue made by a
    ``spawn``-context ``Manager``, which starts a new interpreter (re-importing the training
    script) on the first save of every rank. Synchronous saves write from this process's
    threads only, so an in-process queue is equivalent and starts nothing.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _unwrap(model):
    return getattr(model, "module", model)


def filtered_sharded_state_dict(model, keep) -> dict:
    sd = _unwrap(model).sharded_state_dict(prefix="")
    return {k: v for k, v in sd.items() if keep(k)}


def is_backbone_key(key: str) -> bool:
    return not is_mtp_param(key)


def load_mtp_weights(path: str, model) -> None:
    """Load only the MTP layers' weights of a training checkpoint (no optimizer, no RNG):
    what evaluation needs. Any saved layout loads at this model's layout."""
    _load_filtered(path, model, is_mtp_param)


def _load_filtered(path: str, model, keep) -> None:
    """Load the weights whose names ``keep`` accepts (collective: every rank calls it)."""
    sd = filtered_sharded_state_dict(model, keep)
    load_into(model, dist_checkpointing.load({"model": sd}, path)["model"], keep)


def load_into(model, state_dict: dict, keep) -> None:
    module = _unwrap(model)
    missing, unexpected = module.load_state_dict(state_dict, strict=False)
    expected = {k for k in module.state_dict().keys() if keep(k) and not k.endswith("_extra_state")}
    not_loaded = expected & set(missing)
    if not_loaded or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {sorted(not_loaded)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )


def save_model_checkpoint(path: str, model) -> None:
    """Write every weight of the model (backbone and MTP) as a distributed checkpoint.

    Collective over all ranks. The result is what ``model.init_checkpoint`` (all weights)
    or ``model.backbone_checkpoint`` (backbone only) loads, at any parallel layout.
    """
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    use_in_process_write_results()
    dist_checkpointing.save({"model": filtered_sharded_state_dict(model, lambda k: True)}, path)
    dist.barrier()


def load_model_weights(path: str, model, backbone_only: bool) -> None:
    """Load the backbone (and, unless ``backbone_only``, the MTP layers) from ``path``."""
    if not os.path.isdir(path):
        raise ValueError(f"model checkpoint directory not found: {path}")
    _load_filtered(path, model, is_backbone_key if backbone_only else (lambda k: True))


def load_trained_model(cfg, ckpt_path: str, device):
    """Build the model as the trainer does (``cfg`` after ``setup_parallel``), load the backbone
    (``model.backbone_checkpoint``, ``model.init_checkpoint``, or the seeded initialisation)
    and the trained MTP layers of ``ckpt_path``; eval mode. A training checkpoint holds the
    MTP weights (and optimizer), not the frozen backbone: one whose files changed under the
    recorded path since (re-imported with other weights) is refused, as on resume."""
    from bebop_megatron.model import build_model
    from bebop_megatron.training.fingerprint import backbone_record
    from bebop_megatron.training.same_backbone import backbone_change

    current = backbone_record(cfg.model.backbone_checkpoint, cfg.model.init_checkpoint, cfg.train.seed)
    saved = (dist_checkpointing.load_common_state_dict(ckpt_path).get("common") or {}).get("backbone")
    change = backbone_change(saved, current)
    if change:  # its MTP heads would be measured against (or decode with) another model
        raise BackboneChanged(f"cannot load {ckpt_path}: {change}; restore that backbone (the heads were trained on "
                              "it)")
    model = build_model(cfg, device)
    if cfg.model.backbone_checkpoint:
        load_model_weights(cfg.model.backbone_checkpoint, model, backbone_only=True)
    elif cfg.model.init_checkpoint:
        load_model_weights(cfg.model.init_checkpoint, model, backbone_only=False)
    load_mtp_weights(ckpt_path, model)
    model.eval()
    return model
