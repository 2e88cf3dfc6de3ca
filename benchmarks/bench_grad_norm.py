"""The optimizer step with one gradient-norm pass (now) against two (before), side by side.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_grad_norm.py [--hidden 1024] [--iters 20]
        [--precision fp32|bf16] [--device cpu|cuda]

One process, one Trainer (frozen backbone, one MTP layer of width ``--hidden``). One
forward/backward makes the gradients; then each round restores them and runs, in
alternating order, **before** (the trainer's step until this change: ``prepare_grads`` +
``get_grad_norm`` for the numerics guard, then Megatron's ``optimizer.step()``, which prepares
the gradients and reduces their norm again) and **after** (``Trainer.optimizer_step``:
Megatron's step fed the guard's norm, ``bebop_megatron/platform/grad_norms.py``). Both include
the guard's flag all-reduce and the LR schedule. Reported: median ms per optimizer step,
the ratio after / before, the time of one norm pass alone (what is no longer repeated), and
the saving as a share of a whole step (median forward/backward time of the same model,
measured in the same rounds, plus the old optimizer step). Rows go to ``results.csv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results  # noqa: E402


def step_before(trainer) -> None:
    """Trainer.optimizer_step until one norm pass was shared (finite gradients, one rank)."""
    from bebop_megatron.training.guard import agree_on_flags

    trainer.optimizer.prepare_grads()
    trainer.optimizer.get_grad_norm()
    agree_on_flags(False, False, device=trainer._comm_device)
    trainer.optimizer.step()
    trainer.scheduler.step(increment=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024, help="multiple of 8 (8 heads, 4 query groups)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--note", default="", help="free text recorded as a 'note' row")
    args = p.parse_args()

    import torch

    from bebop_megatron.config import load_config
    from bebop_megatron.training import Trainer

    ffn = -(-args.hidden * 11 // 4 // 64) * 64
    cfg = load_config(overrides=[
        f"device={args.device}", f"precision={args.precision}", "save.dir=null", "train.resume=none",
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={ffn}",
        "model.num_attention_heads=8", "model.num_query_groups=4", "model.vocab_size=2048", "mtp.num_layers=1",
        f"train.seq_length={args.seq}", "train.micro_batch_size=2", "train.global_batch_size=2",
        f"train.steps={2 * args.iters + 2}",
    ])
    load0 = os.getloadavg()[0]
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    batches = next(trainer.batches())
    params = [q for q in trainer.model.module.parameters() if q.requires_grad]
    times = {"before": [], "after": [], "fwd_bwd": [], "norm_pass": []}
    for r in range(args.iters + 1):
        t0 = time.perf_counter()
        trainer.forward_backward(batches)
        sync()
        fb = time.perf_counter() - t0
        grads = [q.main_grad.detach().clone() for q in params]
        order = ("before", "after") if r % 2 else ("after", "before")
        for name in order:
            with torch.no_grad():
                for q, g in zip(params, grads):
                    q.main_grad.copy_(g)
            sync()
            t0 = time.perf_counter()
            step_before(trainer) if name == "before" else trainer.optimizer_step()
            sync()
            if r:  # the first round warms up (Adam state is created lazily)
                times[name].append(time.perf_counter() - t0)
        if r:
            times["fwd_bwd"].append(fb)
            t0 = time.perf_counter()
            trainer.optimizer.get_grad_norm()  # the pass that is no longer repeated, alone
            sync()
            times["norm_pass"].append(time.perf_counter() - t0)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    load1 = os.getloadavg()[0]
    n_params = sum(q.numel() for q in params)
    ratio = ms["after"] / ms["before"]
    saved = (ms["before"] - ms["after"]) / (ms["fwd_bwd"] + ms["before"])
    print(f"hidden={args.hidden} precision={args.precision} device={args.device} trainable={n_params:,} "
          f"threads={torch.get_num_threads()} iters={args.iters} load avg {load0:.1f} -> {load1:.1f}")
    print(f"optimizer step, median ms: before (2 norm passes) {ms['before']:.2f}  after (1 pass) {ms['after']:.2f}"
          f"  after / before = {ratio:.3f}")
    print(f"one norm pass alone: {ms['norm_pass']:.2f} ms = {ms['norm_pass'] / ms['before']:.1%} of the old optimizer "
          f"step; forward/backward median {ms['fwd_bwd']:.1f} ms: the measured saving is {saved:.2%} of a whole step")
    metrics = {"opt_before_ms": ms["before"], "opt_after_ms": ms["after"], "ratio_after_before": ratio,
               "fwd_bwd_ms": ms["fwd_bwd"], "saving_share_of_step": saved, "norm_pass_ms": ms["norm_pass"],
               "load_avg_start": load0, "load_avg_end": load1}
    if args.note:
        metrics["note"] = args.note
    append_results("bench_grad_norm", args.device, {"hidden": args.hidden, "layers": args.layers, "seq": args.seq,
                                                    "precision": args.precision, "trainable": n_params},
                   metrics, torch.__version__)


if __name__ == "__main__":
    main()
