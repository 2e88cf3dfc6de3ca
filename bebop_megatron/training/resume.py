"""What a run starts from, decided by rank 0 before any model is built, and agreed by all ranks.

:func:`plan_start` (rank 0, filesystem only) takes the ``save.dir`` lock, then:

- ``train.resume=none``: refuses a ``save.dir`` that already holds checkpoints unless
  ``save.overwrite=true`` (which deletes them: the new run's steps would otherwise mix with the
  old run's, ``latest`` would move back and ``save.keep_last`` would delete the new files);
- ``train.resume=auto``: picks the checkpoint (``latest``; when it is missing, empty or names
  no complete checkpoint, the newest complete ``iter_N``, with a notice; a ``latest`` that is a
  directory is refused), checks its files
  (:func:`damage`) and compares its saved ``config.yaml`` with this run's config
  (:func:`compare_configs`): changes that define the model, the backbone or the data are
  refused, the others are listed in one notice; a backbone or a training data file whose
  files changed under the same path (their fingerprints, :mod:`bebop_megatron.training.fingerprint`)
  is refused too.

A checkpoint is complete when its directory is ``iter_N`` (not ``.tmp``) and holds Megatron's
``metadata.json`` and torch's ``.metadata``. :func:`agree_on_start` runs the plan on rank 0 and
broadcasts it, so every rank raises the same one-line error or starts from the same checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

from bebop_megatron.config import Config
from bebop_megatron.training import lock
from bebop_megatron.training.checkpoint import CONFIG_FILE, LATEST, list_checkpoints
from bebop_megatron.training.fingerprint import backbone_record, data_record, sampled_file_fingerprint, short
from bebop_megatron.training.same_backbone import backbone_change

METADATA_FILES = ("metadata.json", ".metadata")
DATA_KEYS = ("train.seq_length", "data.train_files", "data.format", "data.tokenizer", "data.train_on", "data.pack", "data.overlong",
             "data.num_samples", "data.markov_branching", "data.markov_min_branching", "data.seed")
"""Fields that define the token rows and their order (``consumed_samples`` counts rows of them)."""
SCHEDULE_KEYS = ("train.lr", "train.min_lr", "train.lr_schedule", "train.warmup_fraction", "train.weight_decay",
                 "train.steps")
"""Allowed: the LR / weight-decay schedule is rebuilt from them and applies from the resumed step."""
ALLOWED_MODEL_KEYS = ("model.transformer_impl", "model.attention_backend", "mtp.init")
"""How layers are implemented and how new MTP weights start: the checkpoint's weights replace them."""


class StartError(ValueError):
    """Refused start (lock, overwrite, damaged or mismatched checkpoint); agreed by every rank."""

    same_on_every_rank = True


@dataclass
class Plan:
    resume_path: str | None = None
    notices: list[str] = field(default_factory=list)
    error: str | None = None
    backbone: dict | None = None  # training.fingerprint.backbone_record, saved in every checkpoint
    train_data: dict | None = None  # training.fingerprint.data_record, saved in every checkpoint

    def records(self) -> dict:
        """What every checkpoint's common state records of the run's inputs."""
        return {"backbone": self.backbone, "train_data": self.train_data}


def is_complete(path: str) -> bool:
    return os.path.isdir(path) and all(os.path.isfile(os.path.join(path, n)) for n in METADATA_FILES)


def complete_checkpoints(save_dir: str) -> list[str]:
    """Paths of the complete checkpoints, oldest first."""
    return [p for p in (os.path.join(save_dir, n) for n in list_checkpoints(save_dir)) if is_complete(p)]


def find_checkpoint(save_dir: str) -> tuple[str | None, str | None]:
    """``(path, notice)``: the checkpoint to resume from (None: start at step 0) and, when
    ``latest`` could not be followed, the line that says what was chosen instead."""
    marker = os.path.join(save_dir, LATEST)
    complete = complete_checkpoints(save_dir)
    if os.path.isfile(marker):
        with open(marker, errors="replace") as f:
            name = f.read().strip()
        if name and "/" not in name and is_complete(os.path.join(save_dir, name)):
            return os.path.join(save_dir, name), None
        problem = "is empty" if not name else f"names {name!r}, which is not a complete checkpoint"
    elif complete:
        problem = "is missing"
    else:
        return None, None  # a new save.dir (or one with partial saves only)
    if not complete:
        return None, f"{marker} {problem} and {save_dir} holds no complete checkpoint: starting at step 0"
    return complete[-1], f"{marker} {problem}: resuming from the newest complete checkpoint {complete[-1]}"


def damage(path: str) -> str | None:
    """What is wrong with a checkpoint's files (unreadable metadata, a missing or truncated
    shard, an unreadable config or common state), or None. Reads metadata only."""
    problem = files_problem(path)
    if problem:
        return problem
    if os.path.exists(os.path.join(path, CONFIG_FILE)) and saved_config(path) is None:
        return f"{CONFIG_FILE} is unreadable"
    try:
        common_state(path)
    except Exception as err:
        return f"its common state is unreadable ({type(err).__name__})"
    return None


def files_problem(path: str) -> str | None:
    """The distributed-checkpoint part of :func:`damage` (any such checkpoint, a model
    checkpoint too): unreadable metadata, a missing or truncated shard; or None."""
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            if not isinstance(json.load(f), dict):
                raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        return f"metadata.json is unreadable or truncated ({type(err).__name__})"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:  # truncated pickle: EOFError, UnpicklingError, ...
        return f".metadata is unreadable or truncated ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) < size:
            return f"{name} is truncated ({os.path.getsize(file)} of at least {size} bytes)"
    return None


def common_state(path: str) -> dict:
    import warnings

    from bebop_megatron.training.checkpoint import read_common_state

    with warnings.catch_warnings():  # rank 0 reads it alone, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return read_common_state(path)


def saved_config(path: str) -> dict | None:
    """The config a checkpoint was written with (``config.yaml``, else the common state's copy)."""
    from omegaconf import OmegaConf

    try:
        file = os.path.join(path, CONFIG_FILE)
        text = open(file).read() if os.path.exists(file) else common_state(path).get("config_yaml")
        saved = OmegaConf.to_container(OmegaConf.create(text)) if text else None
    except Exception:
        return None
    return saved if isinstance(saved, dict) else None


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _refused(key: str, old, new, cfg: Config) -> bool:
    if key in ALLOWED_MODEL_KEYS:
        return False
    if key.startswith(("model.", "mtp.")) or key in DATA_KEYS:
        return True
    if key == "precision":  # bf16 and fp8 share bf16 weights and fp32 optimizer state
        return not {old, new} <= {"bf16", "fp8"}
    if key == "parallel.distributed_optimizer":  # the optimizer state is saved in another format
        return True
    if key == "train.seed":  # seeds the random backbone's initialisation
        return not (cfg.model.backbone_checkpoint or cfg.model.init_checkpoint)
    return False


def compare_configs(saved: dict, cfg: Config) -> tuple[list[str], list[str]]:
    """``(refused, allowed)`` changes from ``saved`` to ``cfg``, each ``'key old -> new'``.
    Fields the saved config lacks (added to the schema later) are not compared."""
    from omegaconf import OmegaConf

    before, now = _flatten(saved), _flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))
    refused, allowed = [], []
    for key in sorted(set(before) & set(now) - {"save.dir"}):  # a moved save.dir: the path is named anyway
        if before[key] != now[key]:
            change = f"{key} {_short(before[key])} -> {_short(now[key])}"
            (refused if _refused(key, before[key], now[key], cfg) else allowed).append(change)
    return refused, allowed


def _short(value) -> str:
    text = "null" if value is None else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def newest_intact_before(save_dir: str, path: str) -> str | None:
    """The newest complete checkpoint of ``save_dir`` older than the ``iter_N`` at ``path`` that
    :func:`damage` finds nothing wrong with (None: there is none, or ``path`` is no ``iter_N``)."""
    if not os.path.basename(path).removeprefix("iter_").isdigit():
        return None
    older = [p for p in complete_checkpoints(save_dir) if p != path and _step(p) < _step(path)]
    return next((p for p in reversed(older) if damage(p) is None), None)


def _step(path: str) -> int:
    return int(os.path.basename(path).removeprefix("iter_"))


def _overwrite(save_dir: str, cfg: Config, plan: Plan) -> None:
    names = [n for n in os.listdir(save_dir) if n.startswith("iter_") or n == LATEST] if os.path.isdir(save_dir) else []
    if not names:
        return
    if not cfg.save.overwrite:
        raise StartError(
            f"save.dir={save_dir} already holds checkpoints ({', '.join(sorted(names)[-3:])}); train.resume=none "
            "would overwrite them: add save.overwrite=true to delete them and start over, use train.resume=auto "
            "to continue, or choose another save.dir"
        )
    for name in names + ["wandb_run_id"]:  # a new run: a new wandb run too
        target = os.path.join(save_dir, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.remove(target)
    plan.notices.append(f"save.overwrite=true: deleted {len(names)} checkpoint entries of a previous run in {save_dir}")


def plan_start(cfg: Config) -> Plan:
    """Rank 0's decision (see the module docstring). Raises :class:`StartError` (one line)."""
    plan = Plan()
    save_dir = cfg.save.dir
    if not save_dir:
        return plan
    try:
        notice = lock.acquire(save_dir)
    except ValueError as err:
        raise StartError(str(err)) from None
    if notice:
        plan.notices.append(notice)
    plan.backbone = backbone_record(cfg.model.backbone_checkpoint, cfg.model.init_checkpoint, cfg.train.seed)
    plan.train_data = data_record(cfg.data.train_files)
    if cfg.train.resume == "none":
        _overwrite(save_dir, cfg, plan)
        return plan
    marker = os.path.join(save_dir, LATEST)
    if os.path.isdir(marker):  # it could never be replaced: the first save would fail on latest.tmp
        raise StartError(f"{marker} is a directory; it must be the file naming the newest checkpoint: move it aside "
                         "(e.g. mv {0} {0}.old) and run again".format(marker))
    path, notice = find_checkpoint(save_dir)
    if notice:
        plan.notices.append(notice)
    if path is None:
        return plan
    problem = damage(path)
    if problem:
        previous = newest_intact_before(save_dir, path)
        hint = (f"the newest intact checkpoint before it is {previous}: move {path} aside (e.g. mv {path} "
                f"{path}.damaged) and run again to resume from it" if previous else
                "there is no intact checkpoint before it: move it aside to start over, or use another save.dir")
        raise StartError(f"checkpoint {path} is damaged: {problem}; {hint}")
    _check_same_backbone(path, plan.backbone)
    _check_same_data(path, plan.train_data)
    saved = saved_config(path)
    if saved is None:
        plan.notices.append(f"{path} holds no saved config: the run's settings cannot be compared")
    else:
        refused, allowed = compare_configs(saved, cfg)
        if refused:
            raise StartError(
                f"cannot resume from {path}: changed {', '.join(refused)}; the checkpoint was trained with the "
                "saved values (they define the model, its backbone, the data or the optimizer state): restore "
                "them, or start a new run in another save.dir (or train.resume=none save.overwrite=true)"
            )
        if allowed:
            step = common_state(path)["step"]
            schedule = any(c.split()[0] in SCHEDULE_KEYS for c in allowed)
            plan.notices.append(
                f"resuming from {path} with changed settings: {', '.join(allowed)}"
                + (f" (the LR schedule is rebuilt from the new values and applies from step {step + 1})"
                   if schedule else "")
            )
    plan.resume_path = path
    return plan


def _check_same_backbone(path: str, current: dict) -> None:
    """Refuse a backbone whose files changed under the same path (a moved or changed path is
    a config change, refused by :func:`compare_configs`)."""
    change = backbone_change(common_state(path).get("backbone"), current)
    if change:
        raise StartError(f"cannot resume from {path}: {change}; restore that backbone, or start a new run in another "
                         "save.dir")


def _sampled_match(file: str, saved: str) -> bool:
    try:
        return sampled_file_fingerprint(file) == saved
    except OSError:
        return False


def _check_same_data(path: str, current: dict) -> None:
    """Refuse a training data file rewritten under the same name since the checkpoint (other
    names are a config change). Older checkpoints record none, or a sampled fingerprint of
    files over 1 MiB (still accepted from them)."""
    saved = common_state(path).get("train_data") or {}
    for file, value in current.items():
        if saved.get(file) and value and saved[file] != value and not _sampled_match(file, saved[file]):
            raise StartError(
                f"cannot resume from {path}: the training data file {file} changed since the checkpoint was "
                f"trained on it (fingerprint {short(value)}, trained on {short(saved[file])}); restore it, or start "
                "a new run in another save.dir (or train.resume=none save.overwrite=true)"
            )


def agree_on_start(cfg: Config, rank: int) -> Plan:
    """Collective: rank 0 plans, every rank gets the plan (or raises the same :class:`StartError`)."""
    import torch.distributed as dist

    plan, unexpected = None, None
    if rank == 0:
        try:
            plan = plan_start(cfg)
        except ValueError as err:
            plan = Plan(error=str(err))
        except OSError as err:  # e.g. save.dir cannot be created
            plan = Plan(error=f"save.dir={cfg.save.dir}: {err.strerror or err}: {err.filename or cfg.save.dir}")
        except Exception as err:  # the other ranks must not wait for rank 0 forever
            plan, unexpected = Plan(error=f"rank 0 failed while preparing save.dir={cfg.save.dir} "
                                          f"({type(err).__name__}: see its error)"), err
    box = [plan]
    dist.broadcast_object_list(box, src=0)
    if unexpected is not None:
        raise unexpected
    if box[0].error:
        raise StartError(box[0].error)
    return box[0]
