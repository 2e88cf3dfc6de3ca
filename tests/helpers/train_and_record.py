"""Run ``Trainer.train()`` (checkpointing and resume included) and record its history.

    torchrun --nproc_per_node 2 tests/helpers/train_and_record.py --out FILE [--save-model PATH] key=value ...
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from bebop_megatron.config import load_config
from bebop_megatron.training import Trainer
from bebop_megatron.training.model_weights import save_model_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-model", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    trainer = Trainer(load_config(overrides=args.overrides), log=lambda *a, **k: None)
    if args.save_model:
        save_model_checkpoint(args.save_model, trainer.model)
    history = trainer.train()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump([{"step": m.step, "loss": m.loss, "top1": m.top1} for m in history], f)
    dist.barrier()


if __name__ == "__main__":
    main()
