"""Training step and peak memory of the two core attentions (``model.attention_backend``) by row length.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_attention.py                  # S = 1k, 4k, 16k
    .venv/bin/python benchmarks/bench_attention.py --seq 256 --layers 12 --hidden 256 --heads 8 --groups 4 \
        --batch 4 --vocab 2048 --mtp-steps 3 --iters 5                              # bench_frozen_step's model
    .venv/bin/python benchmarks/bench_attention.py --device cuda --seq 4096 16384 65536

One training step is the trainer's: ``Trainer.forward_backward`` (frozen backbone forward, MTP
forward, e2e TV loss, backward) + ``Trainer.optimizer_step``, on ``--batch`` rows of S tokens,
as one causal document per row (``causal``) and as ``--docs`` packed documents per row
(``packed``: the per-document attention). Per S, each backend and kind of row runs in its own
worker process (a fresh process per peak-memory reading), all built with the same seed (same
weights and rows) and stepped round-robin so that a change of load hits them alike;
``--warmup`` untimed, then ``--iters`` timed steps (median reported).

Peak memory of the steps: CPU, the process's peak RSS (``ru_maxrss``) after the last step minus
its RSS once the ``Trainer`` and the rows were built; CUDA, ``max_memory_allocated`` minus the
memory allocated then.
The unfused attention holds ``batch x heads x S^2`` float32 scores, masked scores and
probabilities per layer, and their gradients in the MTP layers (measured: 1.7 GB at 4k tokens,
4 heads, about 7 such buffers): it is skipped where ``7 x 4 x batch x heads x S^2`` bytes exceed
``--budget-gib`` (16k tokens, 4 heads: 28 GiB). Self-check: the first step's loss agrees
between the backends (relative 1e-4) for every kind of row, or nothing is recorded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Worker, append_results, reply, rss_mb  # noqa: E402

BACKENDS = ("sdpa", "unfused")
KINDS = ("causal", "packed")


def overrides(args, backend: str, S: int) -> list[str]:
    return [
        f"device={args.device}", "save.dir=null", "train.resume=none", f"model.attention_backend={backend}",
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={2 * args.hidden}",
        f"model.num_attention_heads={args.heads}", f"model.num_query_groups={args.groups}",
        f"model.vocab_size={args.vocab}", f"model.max_position_embeddings={max(S, 4096)}", "mtp.num_layers=1",
        f"mtp.num_steps={args.mtp_steps}", "loss.type=e2e_tv", f"train.seq_length={S}",
        f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}", f"data.num_samples={args.batch}",
    ]


def unfused_gib(args, S: int) -> float:
    return 7 * 4 * args.batch * args.heads * S * S / 2**30


# ------------------------------------------------------------------ worker (one backend, one S)


def worker(args) -> None:
    import torch

    from bebop_megatron.config import load_config
    from bebop_megatron.training import Trainer

    S = args.seq[0]
    cuda = args.device == "cuda"
    cfg = load_config(overrides=overrides(args, args.worker, S))
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    (causal,) = next(trainer.batches())
    n = S // args.docs  # packed: --docs documents of n tokens (the last one takes the rest)
    segments = (torch.arange(S) // n).clamp_max(args.docs - 1).expand(args.batch, S).contiguous()
    positions = (torch.arange(S) - segments[0] * n).expand(args.batch, S).contiguous()
    packed = type(causal)(**{**vars(causal), "segment_ids": segments, "position_ids": positions})
    batch = packed if args.kind == "packed" else causal
    if cuda:
        batch = batch.to(torch.device("cuda"))
        torch.cuda.reset_peak_memory_stats()
    mem_built = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()
    reply({"ready": True})
    for line in sys.stdin:  # "step" ... then anything else ends the worker
        if line.strip() != "step":
            break
        t0 = time.perf_counter()
        outputs = trainer.forward_backward([batch])
        trainer.optimizer_step()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        loss = sum(float(o["loss_sum"]) for o in outputs) / max(sum(int(o["count"]) for o in outputs), 1)
        reply({"s": seconds, "loss": loss})
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb(peak=True)
    reply({"mem_mb": max(peak - mem_built, 0.0), "torch": torch.__version__})


# ------------------------------------------------------------------ driver


def _cmd(args, backend: str, kind: str, S: int) -> list[str]:
    return [sys.executable, __file__, "--worker", backend, "--kind", kind, "--seq", str(S), *(
        f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
            "layers", "hidden", "heads", "groups", "vocab", "mtp_steps", "batch", "docs", "device"))]


def measure(args, S: int) -> dict:
    """``{backend: {kind: {"ms", "mem_mb", "loss0"}}}`` at one S (unfused absent when skipped)."""
    backends = [b for b in BACKENDS if b == "sdpa" or unfused_gib(args, S) <= args.budget_gib]
    workers = {(b, k): Worker(f"{b} {k} S={S}", _cmd(args, b, k, S)) for b in backends for k in KINDS}
    try:
        for w in workers.values():
            w.read()
        steps = {key: [] for key in workers}
        keys = list(workers)
        for r in range(args.warmup + args.iters):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                steps[key].append(workers[key].ask("step"))
        ends = {key: w.ask("end") for key, w in workers.items()}
        return {b: {k: {"ms": 1e3 * statistics.median(x["s"] for x in steps[(b, k)][args.warmup:]),
                        "mem_mb": ends[(b, k)]["mem_mb"], "loss0": steps[(b, k)][0]["loss"]}
                    for k in KINDS} for b in backends}
    finally:
        for w in workers.values():
            w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384], help="row lengths S")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="query groups (GQA)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--mtp-steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="rows per step")
    p.add_argument("--docs", type=int, default=8, help="documents per packed row")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget-gib", type=float, default=8.0, help="skip unfused where its attention needs more")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    args.warmup = max(args.warmup, 1)
    t_start = time.perf_counter()
    model = (f"layers={args.layers} hidden={args.hidden} heads={args.heads} groups={args.groups} vocab={args.vocab} "
             f"K={args.mtp_steps} batch={args.batch} docs={args.docs}")
    print(f"{model} device={args.device} warmup={args.warmup} iters={args.iters}")
    print(f"{'S':>7} {'rows':<7}{'sdpa ms':>10}{'unfused ms':>12}{'unf/sdpa':>10}{'sdpa MB':>10}{'unfused MB':>12}")
    failures, records = [], []
    for S in args.seq:
        res = measure(args, S)
        sdpa, unfused = res["sdpa"], res.get("unfused")
        for kind in KINDS:
            a, b = sdpa[kind], unfused[kind] if unfused else None
            if b is not None and abs(a["loss0"] - b["loss0"]) > 1e-4 * max(abs(b["loss0"]), 1):
                failures.append(f"S={S} {kind}: first-step loss sdpa {a['loss0']:.6f} != unfused {b['loss0']:.6f}")
            skipped = f"skipped (needs ~{unfused_gib(args, S):.0f} GiB)"
            print(f"{S:>7} {kind:<7}{a['ms']:>10.1f}" + (
                f"{b['ms']:>12.1f}{b['ms'] / a['ms']:>10.2f}{a['mem_mb']:>10.1f}{b['mem_mb']:>12.1f}" if b else
                f"{'-':>12}{'-':>10}{a['mem_mb']:>10.1f}  unfused {skipped}"))
            metrics = {"step_sdpa_ms": a["ms"], "mem_sdpa_mb": a["mem_mb"], "loss0": a["loss0"]}
            metrics.update({"step_unfused_ms": b["ms"], "mem_unfused_mb": b["mem_mb"], "ratio_unfused_sdpa":
                            b["ms"] / a["ms"], "mem_ratio_unfused_sdpa": b["mem_mb"] / max(a["mem_mb"], 1e-9)}
                           if b else {"unfused": skipped})
            records.append(({"S": S, "rows": kind, **dict(x.split("=") for x in model.split())}, metrics))
    if failures:
        sys.exit("SELF-CHECK FAILED (no results recorded): " + "; ".join(failures))
    import torch

    for params, metrics in records:
        append_results("bench_attention", args.device, params, metrics, torch.__version__)
    print(f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
