"""Load a full model checkpoint at the launched layout and save it again at that layout.

    torchrun --nproc_per_node 2 tests/helpers/convert_reshard_case.py --ckpt IN --out OUT parallel.pipeline=2

or as a call of a launch of tests/helpers/cli_batch.py (``main(argv)``).

The export test converts both ``IN`` (written at TP=1) and ``OUT`` (written at this layout)
to HF and compares the files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bebop_megatron.config import load_config  # noqa: E402  (quiets Megatron's notices first)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.model_weights import load_model_weights, save_model_checkpoint
    from bebop_megatron.training.parallel import setup_parallel

    cfg = load_config(os.path.join(args.ckpt, "bebop_model.yaml"),
                      ["device=cpu", "save.dir=null", "train.resume=none", "model.transformer_impl=local",
                       *args.overrides])
    rank, world = init_distributed("cpu")
    setup_parallel(cfg, world)
    model = build_model(cfg, "cpu")
    load_model_weights(args.ckpt, model, backbone_only=False)
    save_model_checkpoint(args.out, model)
    if rank == 0:
        shutil.copytree(os.path.join(args.ckpt, "hf"), os.path.join(args.out, "hf"))
    dist.barrier()


if __name__ == "__main__":
    main()
