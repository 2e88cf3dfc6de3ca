"""Run ``Trainer.train()`` under the CLI's exit handling, streaming each step to a JSONL file,
with optional faults injected (the tests in tests/distributed/test_crash_*.py and
tests/test_production_*.py).

    python tests/helpers/production_run.py --stream FILE [--nan-steps 2,4] [--crash-in-save N]
        [--disk-full-in-save N] [--disk-full-in-metadata N] [--report-exit] [--save-model PATH] key=value ...

Launched directly, one process per rank (RANK / WORLD_SIZE / MASTER_* set by the test, as srun
would), so that each rank's exit status and signals are the test's to see. Every rank writes
its pid to ``FILE.pid<rank>``; rank 0 appends ``{"step", "loss", "skipped", "checksum"}`` after
every step (``checksum``: the sum of this rank's MTP parameters, to see whether an update ran).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal

import torch

from bebop_megatron.cli import run_cli
from bebop_megatron.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", required=True)
    parser.add_argument("--nan-steps", default="", help="steps whose loss is multiplied by NaN")
    parser.add_argument("--crash-in-save", type=int, default=0, help="SIGKILL every rank inside the N-th save")
    parser.add_argument("--disk-full-in-save", type=int, default=0,
                        help="the N-th save's shard writes fail with ENOSPC on rank 0 (a full disk)")
    parser.add_argument("--disk-full-in-metadata", type=int, default=0,
                        help="the N-th save's .metadata write (rank 0 alone writes it) fails with ENOSPC")
    parser.add_argument("--report-exit", action="store_true",
                        help="print at interpreter exit (after the trainer's own exit handlers) whether the "
                             "process group is still alive")
    parser.add_argument("--save-model", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(overrides=args.overrides)
    if args.report_exit:  # registered first, so it runs after every handler registered later
        import atexit
        import sys

        import torch.distributed as dist

        atexit.register(lambda: print(f"at exit: process group {'alive' if dist.is_initialized() else 'destroyed'}",
                                      file=sys.stderr, flush=True))

    from bebop_megatron.training import checkpoint as ckpt
    from bebop_megatron.training import model_weights
    from bebop_megatron.training import trainer as trainer_module

    trainer = trainer_module.Trainer(cfg)
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{args.stream}.pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    if args.save_model:
        model_weights.save_model_checkpoint(args.save_model, trainer.model)

    nan_steps = {int(s) for s in args.nan_steps.split(",") if s}
    if nan_steps:
        real_loss = trainer_module.mtp_loss

        def poisoned_loss(*a, **k):
            loss_sum, count, stats = real_loss(*a, **k)
            if trainer.step + 1 in nan_steps:
                loss_sum = loss_sum * float("nan")
            return loss_sum, count, stats

        trainer_module.mtp_loss = poisoned_loss

    if args.crash_in_save:
        real_save, calls = ckpt.dist_checkpointing.save, []

        def crashing_save(state, directory, *a, **k):
            calls.append(directory)
            if len(calls) == args.crash_in_save:
                with open(os.path.join(directory, f"__{rank}_0.distcp"), "wb") as f:
                    f.write(b"half a shard")  # a partial write, then the node dies
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(state, directory, *a, **k)

        ckpt.dist_checkpointing.save = crashing_save

    if args.disk_full_in_save:
        import errno

        from megatron.core.dist_checkpointing.strategies import filesystem_async

        real_save, real_write, saves = ckpt.dist_checkpointing.save, filesystem_async._write_item, []

        def counting_save(state, directory, *a, **k):
            saves.append(directory)
            return real_save(state, directory, *a, **k)

        @functools.wraps(real_write)  # Megatron inspects its signature
        def full_disk_write(*a, **k):
            if len(saves) == args.disk_full_in_save and rank == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what write() raises: no file name
            return real_write(*a, **k)

        ckpt.dist_checkpointing.save = counting_save
        filesystem_async._write_item = full_disk_write

    if args.disk_full_in_metadata:  # the shards fitted, the file rank 0 writes after them did not
        import errno

        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        real_save, real_finish, saves = ckpt.dist_checkpointing.save, FileSystemWriter.finish, []

        def counting_save(state, directory, *a, **k):
            saves.append(directory)
            return real_save(state, directory, *a, **k)

        def full_disk_finish(self, *a, **k):
            if len(saves) == args.disk_full_in_metadata:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what write() raises: no file name
            return real_finish(self, *a, **k)

        ckpt.dist_checkpointing.save = counting_save
        FileSystemWriter.finish = full_disk_finish

    real_step = trainer.train_step
    mtp = [p for p in trainer.model.parameters() if p.requires_grad]

    def recorded_step(micro_batches):
        metrics = real_step(micro_batches)
        if rank == 0:
            checksum = float(sum(p.detach().double().sum() for p in mtp)) if mtp else 0.0
            row = {"step": metrics.step, "loss": metrics.loss, "skipped": metrics.extra["skipped"], "checksum": checksum}
            with open(args.stream, "a") as f:
                f.write(json.dumps(row) + "\n")
        return metrics

    trainer.train_step = recorded_step
    trainer.train()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_cli(main)
