"""Run ``Trainer.train()`` (checkpointing and resume included) and record its history.

    torchrun --nproc_per_node 2 tests/helpers/train_and_record.py --out FILE [--save-model PATH] key=value ...
    torchrun --nproc_per_node 2 tests/helpers/train_and_record.py --cases cases.json

``--cases``: a JSON list of ``{"out": FILE, "overrides": [...], "save_model": PATH or null,
"before": [OP, ...]}``, run one after the other in this launch (each builds its own Trainer:
process groups, model, optimizer, and resumes from its ``save.dir`` as a new run would), which
saves the start-up of a launch per run. ``before``: file operations rank 0 makes between the
previous run and this one (all ranks wait for them): ``["rmtree", PATH]``, ``["write", PATH,
TEXT]``, ``["copytree", SRC, DST]`` (without the ``run.lock`` the previous run, in this same
process, still holds: a separate process would have released it at exit).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch.distributed as dist

from bebop_megatron.config import load_config
from bebop_megatron.training import Trainer
from bebop_megatron.training.model_weights import save_model_checkpoint


def apply(op: list[str]) -> None:
    kind, *args = op
    if kind == "rmtree":
        shutil.rmtree(args[0])
    elif kind == "write":
        Path(args[0]).write_text(args[1])
    elif kind == "copytree":
        shutil.copytree(args[0], args[1], ignore=shutil.ignore_patterns("run.lock"))
    else:
        raise ValueError(f"unknown operation {op}")


def train_and_record(out: str, overrides: list[str], save_model: str | None, before: list) -> None:
    if before:  # a previous case initialised the process group
        if dist.get_rank() == 0:
            for op in before:
                apply(op)
        dist.barrier()
    trainer = Trainer(load_config(overrides=overrides), log=lambda *a, **k: None)
    if save_model:
        save_model_checkpoint(save_model, trainer.model)
    history = trainer.train()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump([{"step": m.step, "loss": m.loss, "top1": m.top1} for m in history], f)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--save-model", default=None)
    parser.add_argument("--cases", default=None, help="JSON list of runs instead of --out/overrides")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.cases:
        cases = json.loads(Path(args.cases).read_text())
        assert not cases[0].get("before"), "the first case runs before any process group exists"
    else:
        cases = [{"out": args.out, "overrides": args.overrides, "save_model": args.save_model}]
    for case in cases:
        train_and_record(case["out"], case["overrides"], case.get("save_model"), case.get("before", []))


if __name__ == "__main__":
    main()
