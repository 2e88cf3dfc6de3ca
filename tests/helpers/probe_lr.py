"""Train with the optimizer's updates observed; JSON on stdout.

    python tests/helpers/probe_lr.py --metrics-file FILE key=value ...

For every update: the LR in the param groups when torch's Adam stepped (the LR the update
used) and the largest |weight change| it made; also the LRs the console lines show (the
metrics file holds the same run's ``train/lr``).
"""

from __future__ import annotations

import argparse
import json

import torch

from bebop_megatron.config import load_config
from bebop_megatron.training import Trainer


def observe(opt, record: list) -> None:
    step = opt.step

    def observed(*args, **kwargs):
        params = [p for group in opt.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        lrs = sorted({group["lr"] for group in opt.param_groups})
        result = step(*args, **kwargs)
        change = max(float((p.detach() - b).abs().max()) for p, b in zip(params, before))
        record.append({"lr": lrs, "max_change": change})
        return result

    opt.step = observed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--metrics-file", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(overrides=["device=cpu", "save.dir=null", "train.resume=none",
                                 f"logging.metrics_file={args.metrics_file}", *args.overrides])
    lines: list[str] = []
    trainer = Trainer(cfg, log=lambda line="", *a, **k: lines.append(str(line)))
    updates: list = []
    for chained in trainer.optimizer.chained_optimizers:
        observe(chained.optimizer, updates)
    history = trainer.train()
    console = [line.split("| lr ")[1].split(" |")[0] for line in lines if line.startswith("step ")]
    print(json.dumps({"logged": [m.lr for m in history], "console": console, "updates": updates}))


if __name__ == "__main__":
    main()
