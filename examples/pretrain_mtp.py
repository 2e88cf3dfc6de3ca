"""Train MTP draft heads on a frozen backbone with Megatron-Core.

    # the embedded default: a tiny model on synthetic data, CPU, TP=2, 50 steps; its backbone is
    # fitted to the synthetic language first (once, cached in ~/.cache/bebop_megatron)
    torchrun --nproc_per_node 2 examples/pretrain_mtp.py

    # single process, any overrides
    python examples/pretrain_mtp.py parallel.tensor=1 train.steps=20

    # a YAML config (it replaces the embedded default) plus overrides
    torchrun --nproc_per_node 2 examples/pretrain_mtp.py --config examples/configs/tiny_moe_cpu.yaml train.steps=10

All logic lives in ``bebop_megatron``; this file only wires the config to the trainer.
"""

import sys

from bebop_megatron.cli import parse_config, run_cli

# What the command runs with no arguments: CPU, tensor-parallel over the two torchrun ranks.
EMBEDDED_DEFAULT = {
    "device": "cpu",
    "parallel": {"tensor": 2},
    # A backbone with real structure: fitted to a synthetic language whose entropy varies by token.
    "model": {"backbone_init": "fit_synthetic"},
    "data": {"markov_branching": 32, "markov_min_branching": 2},
    "train": {"steps": 50, "micro_batch_size": 4, "global_batch_size": 8, "seq_length": 64, "lr": 1e-3},
    "save": {"dir": "checkpoints/tiny"},
}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(sys.argv[1:] if argv is None else argv, description=__doc__.split("\n")[0], defaults=EMBEDDED_DEFAULT)
    from bebop_megatron.training import Trainer  # after the config checks: Megatron imports take seconds

    Trainer(cfg).train()


if __name__ == "__main__":
    run_cli(main)
