"""Checkpoints with Megatron distributed checkpointing (reshards across TP/PP/EP/DP on load).

Training checkpoints hold the MTP weights, the optimizer, the step, the data position and
the RNG state; the frozen backbone is not copied (``model.backbone_checkpoint`` names it).
A checkpoint is written to ``iter_NNNNNNN.tmp`` and renamed once complete; ``latest`` is
replaced atomically afterwards, so a crash mid-save never leaves ``latest`` pointing at a
partial checkpoint. Only then are checkpoints beyond ``save.keep_last`` deleted (never the one
``latest`` names). Each checkpoint directory also holds ``config.yaml``, the resolved config
of the run that wrote it. Model weights alone (a whole model, or the trained model of a
training checkpoint) are :mod:`bebop_megatron.training.model_weights`.

With an :class:`AsyncSaver` the shards are written by a forked writer process (Megatron-Core's
``mcore`` async strategy; it works on CPU with gloo as well as on CUDA) while training goes
on; the rename and ``latest`` happen in its finalize step, once every rank's writer is done.
The writers report through a ``spawn``-context ``Manager`` process, which re-imports the
``__main__`` script: async saves need an entry point guarded by ``if __name__ == "__main__"``.
That process ignores the job's SIGTERM / SIGUSR1 (the launcher signals the whole process
group; the rank handles them and still needs it for its final save) and exits with its rank.
"""

from __future__ import annotations

import functools
import os
import re
import shutil

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from bebop_megatron.model import is_mtp_param
from bebop_megatron.platform import torch_adam
from bebop_megatron.platform.atomic import write_atomic
from bebop_megatron.platform.checkpoint_writer import deferred_coordinator_errors, record_write_errors
from bebop_megatron.training.model_weights import filtered_sharded_state_dict, load_into, use_in_process_write_results
from bebop_megatron.training.model_weights import load_trained_model  # noqa: F401  (re-exported)
from bebop_megatron.training.write_errors import CheckpointWriteError, raise_agreed_write_error, write_problem

LATEST = "latest"
CONFIG_FILE = "config.yaml"
_CHECKPOINT_NAME = re.compile(r"^iter_(\d+)$")


def _rng_sharded_object(world_rank: int, world_size: int):
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject("rng_state", state, (world_size,), (world_rank,), replica_id=0)


def _shielded_results_queue():
    """Megatron's queue for the forked writers' results (a ``spawn``-context manager's queue,
    as ``get_write_results_queue`` makes it), served by a manager that survives the job's signals.

    srun, scancel and torchrun signal the whole process group: Megatron's manager died of it,
    and the preemption save failed (BrokenPipeError in the writer, the checkpoint left ``.tmp``).
    This one ignores them and exits with its rank (:func:`bebop_megatron.launcher.shield_helper`).
    """
    import multiprocessing as mp
    import signal
    from multiprocessing.managers import SyncManager

    from bebop_megatron.launcher import HELPER_IGNORED_SIGNALS, shield_helper

    manager = SyncManager(ctx=mp.get_context("spawn"))
    # The new interpreter inherits this thread's signal mask: blocked until the initializer
    # ignores them (importing takes seconds); here they stay pending, none is lost.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_IGNORED_SIGNALS)
    try:
        manager.start(initializer=shield_helper, initargs=(os.getpid(),))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return manager.Queue()  # the proxy holds the manager: it lives as long as the queue


class AsyncSaver:
    """One background checkpoint write at a time (Megatron-Core ``AsyncCallsQueue``).

    ``poll()`` once per step finalizes a finished write (a collective: call it on every rank);
    ``wait()`` blocks until the write in flight is published (before the next save, at the
    end of training and before a preemption exit).
    """

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        # The writer is a forked process: results must go through a process-shared queue.
        if not hasattr(filesystem_async._results_queue, "_token"):  # None, or the in-process queue
            filesystem_async._results_queue = _shielded_results_queue()
        self.queue = AsyncCallsQueue()
        self.pending: str | None = None  # the .tmp directory being written

    def poll(self) -> None:
        self._finalize(blocking=False)

    def wait(self) -> None:
        self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        failure = None
        try:
            with deferred_coordinator_errors():
                self.queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as err:  # torch's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit, CheckpointWriteError)):
                raise  # CheckpointWriteError: already agreed by every rank (in _publish)
            failure = err
        else:
            return
        raise_agreed_write_error(failure, self.pending or "the checkpoint")  # every rank's finalize raised

    def close(self) -> None:
        self.wait()
        self.queue.close()


def save_training_checkpoint(
    save_dir: str, step: int, model, optimizer, common: dict, keep_last: int = 0, async_saver: AsyncSaver | None = None
) -> str:
    """Collective over all ranks. Returns the final directory of the checkpoint.

    ``common["config_yaml"]``, when present, is also written as ``config.yaml`` inside the
    checkpoint; ``keep_last > 0`` deletes all but the newest ``keep_last`` checkpoints after
    ``latest`` has moved. With ``async_saver`` the call returns once the state is staged;
    the checkpoint appears under its final name when the saver finalizes it.
    """
    if async_saver is not None:
        async_saver.wait()  # one write in flight: the previous checkpoint is published first
    name = f"iter_{step:07d}"
    final = os.path.join(save_dir, name)
    tmp = final + ".tmp"
    rank, world = dist.get_rank(), dist.get_world_size()
    failure = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as err:  # a full disk: every rank stops with the same line
            failure = err
    raise_agreed_write_error(failure, tmp)  # also the barrier before the shards are written
    if async_saver is None:
        use_in_process_write_results()
    state = {"common": common, "rng_state": _rng_sharded_object(rank, world)}
    model_sd = filtered_sharded_state_dict(model, is_mtp_param)
    if model_sd:
        state["model"] = model_sd
    state["optimizer"] = _same_common_state_on_all_stages(_optimizer_state(optimizer, model_sd), bool(model_sd))
    publish = functools.partial(_publish, save_dir, name, keep_last, common.get("config_yaml"))
    record_write_errors()
    if async_saver is None:
        try:
            with deferred_coordinator_errors():
                dist_checkpointing.save(state, tmp)
        except BaseException as err:  # torch's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            failure = err
        raise_agreed_write_error(failure, tmp)
        publish()
    else:
        request = dist_checkpointing.save(state, tmp, async_sharded_save=True, async_strategy="mcore")
        request.add_finalize_fn(publish)  # runs after Megatron's own metadata finalize
        async_saver.pending = tmp
        async_saver.queue.schedule_async_request(request)
    return final


def _publish(save_dir: str, name: str, keep_last: int, config_yaml: str | None) -> None:
    """Add ``config.yaml``, rename the complete ``NAME.tmp`` to ``NAME``, then move ``latest``
    (collective). First every rank agrees that the write succeeded (rank 0's ``.metadata`` and
    ``metadata.json`` errors are recorded, not raised: ``deferred_coordinator_errors``)."""
    raise_agreed_write_error(None, os.path.join(save_dir, name) + ".tmp")  # also the barrier
    problem = None
    if dist.get_rank() == 0:
        final = os.path.join(save_dir, name)
        try:
            if config_yaml is not None:
                with open(os.path.join(final + ".tmp", CONFIG_FILE), "w") as f:
                    f.write(config_yaml)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(final + ".tmp", final)
            write_atomic(os.path.join(save_dir, LATEST), name)
        except OSError as err:
            problem = write_problem(err, final + ".tmp")
        else:
            _remove_partial_saves(save_dir, older_than=name)
            if keep_last:
                prune_checkpoints(save_dir, keep_last)
    box = [problem]
    dist.broadcast_object_list(box, src=0)  # also the barrier that ends the publish
    if box[0]:
        raise CheckpointWriteError(box[0])


def _remove_partial_saves(save_dir: str, older_than: str) -> None:
    """Delete ``iter_N.tmp`` directories left by a crashed run (steps before ``older_than``)."""
    newest = int(_CHECKPOINT_NAME.match(older_than).group(1))
    for entry in os.listdir(save_dir):
        match = _CHECKPOINT_NAME.match(entry.removesuffix(".tmp"))
        if entry.endswith(".tmp") and match and int(match.group(1)) < newest:
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)


def list_checkpoints(save_dir: str) -> list[str]:
    """Names of the complete checkpoints in ``save_dir`` (``iter_N``, no ``.tmp``), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    names = [n for n in os.listdir(save_dir) if _CHECKPOINT_NAME.match(n)]
    return sorted(names, key=lambda n: int(_CHECKPOINT_NAME.match(n).group(1)))


def prune_checkpoints(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints, never the one ``latest`` names.
    Returns the deleted names."""
    latest = latest_checkpoint(save_dir)
    keep = set(list_checkpoints(save_dir)[-keep_last:]) | ({os.path.basename(latest)} if latest else set())
    deleted = [n for n in list_checkpoints(save_dir) if n not in keep]
    for name in deleted:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    return deleted


def _same_common_state_on_all_stages(opt_sd: dict, has_mtp: bool) -> dict:
    """Give backbone-only stages the MTP stage's non-sharded optimizer state.

    Rank 0 writes the common (non-sharded) part of a checkpoint, and rank 0 may hold only
    backbone layers, whose empty optimizer lacks e.g. Adam's ``common_step``. Every rank
    therefore takes the common part from the last stage of its pipeline.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return opt_sd
    _, common_part = extract_sharded_base(opt_sd)
    obj = [common_part]
    dist.broadcast_object_list(
        obj,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return opt_sd if has_mtp else obj[0]


def latest_checkpoint(save_dir: str | None) -> str | None:
    """The newest complete checkpoint in ``save_dir`` (None if there is none)."""
    if not save_dir:
        return None
    marker = os.path.join(save_dir, LATEST)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        path = os.path.join(save_dir, f.read().strip())
    return path if os.path.isdir(path) else None


def read_common_state(path: str) -> dict:
    """The non-sharded ``common`` entry of a training checkpoint (step, data position, layout)."""
    return dist_checkpointing.load_common_state_dict(path)["common"]


def _optimizer_state(optimizer, model_sd: dict, is_loading: bool = False) -> dict:
    """The optimizer's sharded state. Megatron-Core 0.19's distributed optimizer defaults to the
    deprecated 'fully_sharded_model_space' format, whose flattened ShardedTensors its own
    dist_checkpointing refuses ("flattened_range is not supported"); 'fully_reshardable' (as
    Megatron-LM's --dist-ckpt-optim-fully-reshardable) loads at any layout, and the MTP-only
    state it gathers on each DP rank 0 is small."""
    metadata = None
    if getattr(getattr(optimizer, "config", None), "use_distributed_optimizer", False):
        metadata = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
        if is_loading:
            torch_adam.give_fresh_adam_state(optimizer)
            torch_adam.skip_step_when_loading()
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)


def load_training_checkpoint(path: str, model, optimizer, restore_rng: bool) -> None:
    """Load MTP weights, optimizer and (if ``restore_rng``) this rank's RNG streams."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict = {}
    model_sd = filtered_sharded_state_dict(model, is_mtp_param)
    if model_sd:  # backbone-only stages have nothing to restore but the common state
        state["model"] = model_sd
        state["optimizer"] = _optimizer_state(optimizer, model_sd, is_loading=True)
    if restore_rng:
        state["rng_state"] = _rng_sharded_object(rank, world)
    loaded = dist_checkpointing.load(state, path)
    if model_sd:
        load_into(model, loaded["model"], is_mtp_param)
        current = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        _adopt_current_schedule(loaded["optimizer"], optimizer.param_groups)
        optimizer.load_state_dict(loaded["optimizer"])
        for group, settings in zip(optimizer.param_groups, current):
            group.update(settings)  # this run's Adam settings (betas, eps, ...), not the saved ones
    if restore_rng:
        rng = loaded["rng_state"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])


_SCHEDULE_GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def _adopt_current_schedule(opt_state, current_groups: list) -> None:
    """Give the saved param groups this run's LR / weight-decay schedule values.

    Megatron pairs saved and current param groups by identifier tuples that include
    ``max_lr`` / ``min_lr`` / ``start_wd`` / ``end_wd``, so a resume with another ``train.lr``
    failed ("Could not find parameter group"). Each saved group whose other identifiers match
    a current group takes that group's schedule values: the new schedule applies from the
    resumed step on (``Trainer`` rebuilds the scheduler at the resumed step).
    """
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    def rest(group: dict) -> tuple:
        return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys
                     if k not in _SCHEDULE_GROUP_KEYS)

    schedule: dict[tuple, set] = {}
    for group in current_groups:
        schedule.setdefault(rest(group), set()).add(tuple((k, group[k]) for k in _SCHEDULE_GROUP_KEYS if k in group))
    for groups in _param_group_lists(opt_state):
        for group in groups:
            values = schedule.get(rest(group), set())
            if len(values) == 1:
                for key in _SCHEDULE_GROUP_KEYS:
                    group.pop(key, None)  # absent and None mean the same to Megatron's matching
                group.update(next(iter(values)))


def _param_group_lists(tree):
    """Every ``param_groups`` list in a (possibly chained) optimizer state dict."""
    if isinstance(tree, dict):
        if isinstance(tree.get("param_groups"), list):
            yield tree["param_groups"]
        for key, value in tree.items():
            if key != "param_groups":
                yield from _param_group_lists(value)
