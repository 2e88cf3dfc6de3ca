"""Context parallelism (``parallel.context``): step time and peak memory per rank of one long row, C=1 vs C=2.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_context_parallel.py          # S = 32K, 64K, 128K; hours on CPU
    .venv/bin/python benchmarks/bench_context_parallel.py --seq 32768 --steps 2      # one length, one timed step
    .venv/bin/python benchmarks/bench_context_parallel.py --device cuda              # >= 2 GPUs (C=2 needs two)
    .venv/bin/python benchmarks/bench_context_parallel.py --dry-run                  # tiny sizes, seconds

One training step is the trainer's (``Trainer.forward_backward`` + ``Trainer.optimizer_step``:
frozen backbone forward, MTP forward, the configured loss, backward, optimizer) on one row of S
tokens (micro-batch = global batch = 1, synthetic data, random backbone), fp32, SDPA attention.
Per S and C, one ``torchrun --nproc_per_node C`` launch of this script (a fresh process per rank
gives each its own peak-memory reading); the variants run one after the other, never together
(C=2 takes both ranks' cores). Each rank runs ``--threads`` threads (default 1: a rank is one
core, as a rank is one GPU on a GPU machine, so C=2 brings twice the compute). ``--steps`` steps,
the first a warm-up (not timed); a step's time is the slowest rank's (every rank starts it after
a barrier); reported: the median of the timed steps.

Peak memory per rank: CPU, the kernel's resident-set high-water mark of the rank's process
(``VmHWM`` in ``/proc/self/status``, read after the last step: everything the process ever held
resident, weights and the Python runtime included, exact, not sampled); also ``step MB``, that
peak minus the resident set once the ``Trainer`` and the row were built. CUDA:
``torch.cuda.max_memory_allocated`` (and minus ``memory_allocated`` once built). The figure is
the largest over the ranks.

Self-check: every step's loss at C=2 equals C=1's (same weights and rows; relative 1e-5, fp32),
else ``SELF-CHECK FAILED`` and that S is not recorded. Rows are appended to ``results.csv`` (or
``$BENCH_RESULTS_CSV``) after each S, so a long run keeps the lengths it finished; ``--dry-run``
records only where ``$BENCH_RESULTS_CSV`` is set. Record only rows measured on an idle machine:
the load average is printed before and after each variant, and the cores other processes used
meanwhile (the machine's busy CPU time from ``/proc/stat`` less the benchmark's own), with a
warning above 0.2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TAG, append_results, device_label, free_port, reply, rss_mb  # noqa: E402

REL_TOL = 1e-5
DRY = {"seq": [64], "steps": 2, "layers": 1, "hidden": 32, "heads": 2, "groups": 1, "vocab": 64}


def overrides(args, S: int, C: int) -> list[str]:
    return [
        f"device={args.device}", "precision=fp32", "save.dir=null", "train.resume=none", "parallel.tensor=1",
        f"parallel.context={C}", "model.attention_backend=sdpa", "model.transformer_impl=local",
        "model.backbone_init=random", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.ffn_hidden_size={2 * args.hidden}", f"model.num_attention_heads={args.heads}",
        f"model.num_query_groups={args.groups}", f"model.vocab_size={args.vocab}",
        f"model.max_position_embeddings={max(S, 4096)}", "mtp.num_layers=1", f"mtp.num_steps={args.mtp_steps}",
        *([f"loss.type={args.loss}"] if args.loss else []), f"train.seq_length={S}", "train.micro_batch_size=1",
        "train.global_batch_size=1", f"train.steps={args.steps}", "data.num_samples=1",
    ]


def peak_rss_mb() -> float:
    """The process's resident high-water mark (VmHWM: per address space, so a fresh one after the
    exec that started this rank), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    return rss_mb(peak=True)


def check_args(args) -> str | None:
    """One line saying what is wrong with the lengths, steps or rank counts, or None."""
    if args.steps < 2:
        return f"--steps {args.steps}: needs at least 2 (the first step is a warm-up, not timed)"
    if args.threads < 1:
        return f"--threads {args.threads} must be >= 1"
    for C in args.cp:
        if C < 1:
            return f"--cp {C} must be >= 1"
        for S in args.seq:
            if S <= 0 or S % (2 * C):
                return (f"--seq {S} is not divisible by 2 x C = {2 * C} (C={C}: each row is split into 2C chunks, "
                        f"rank r holds chunks r and 2C-1-r)")
            if S // (2 * C) < args.mtp_steps:
                return (f"--seq {S} at C={C}: a chunk of S/2C = {S // (2 * C)} positions is shorter than "
                        f"--mtp-steps {args.mtp_steps}")
    if args.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if max(args.cp) > have:
            return f"--cp {max(args.cp)} needs {max(args.cp)} GPUs (one per rank); this machine has {have}"
    return None


# ------------------------------------------------------------------ worker (one rank of one S, C)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from bebop_megatron.config import load_config
    from bebop_megatron.training import Trainer

    torch.set_num_threads(args.threads)
    S, C = args.seq[0], args.cp[0]
    cuda = args.device == "cuda"
    trainer = Trainer(load_config(overrides=overrides(args, S, C)), log=lambda *a, **k: None)
    (batch,) = next(trainer.batches())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    built = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()
    rank = dist.get_rank()
    steps = []
    for i in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        outputs = trainer.forward_backward([batch])
        trainer.optimizer_step(outputs)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        steps.append({"s": seconds, "loss_sum": sum(float(o["loss_sum"]) for o in outputs),
                      "count": sum(int(o["count"]) for o in outputs)})
        reply({"rank": rank, "progress": i + 1, "s": seconds})
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
    reply({"rank": rank, "steps": steps, "peak_mb": peak, "step_mb": max(peak - built, 0.0),
           "threads": torch.get_num_threads(), "torch": torch.__version__})


# ------------------------------------------------------------------ driver


def summarise(ranks: list[dict], warmup: int = 1) -> dict:
    """The ranks' answers (one per rank) -> the variant's step time (median over the timed steps of
    the slowest rank's time), loss per step (sums over the ranks' positions), peak memory per rank."""
    n = len(ranks[0]["steps"])
    wall = [max(r["steps"][i]["s"] for r in ranks) for i in range(n)]
    losses = [sum(r["steps"][i]["loss_sum"] for r in ranks) / max(sum(r["steps"][i]["count"] for r in ranks), 1)
              for i in range(n)]
    return {"ms": 1e3 * statistics.median(wall[warmup:]), "losses": losses,
            "peak_mb": max(r["peak_mb"] for r in ranks), "step_mb": max(r["step_mb"] for r in ranks),
            "threads": ranks[0]["threads"], "torch": ranks[0]["torch"]}


def loss_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def table(rows: list, cp: list[int]) -> list[str]:
    """The side-by-side table: per S, each C's step time and peak MB per rank, then each C's ratios
    to the smallest C (time, peak memory per rank) and its largest relative loss difference."""
    base = min(cp)
    others = [C for C in cp if C != base]
    head = f"{'S':>8}" + "".join(f"{f'C={C} ms':>12}{f'C={C} MB/rank':>15}" for C in cp)
    head += "".join(f"{f'time C{C}/C{base}':>14}{f'mem C{C}/C{base}':>13}{'loss diff':>11}" for C in others)
    lines = [head]
    for S, res, diffs in rows:
        line = f"{S:>8}" + "".join(f"{res[C]['ms']:>12.0f}{res[C]['peak_mb']:>15.0f}" for C in cp)
        line += "".join(f"{res[C]['ms'] / res[base]['ms']:>14.3f}{res[C]['peak_mb'] / res[base]['peak_mb']:>13.3f}"
                        f"{diffs[C]:>11.1e}" for C in others)
        lines.append(line)
    return lines


OTHER_CORES_LIMIT = 0.2


def _busy_cpu_s() -> float:
    """CPU seconds every process of the machine has used since boot (``/proc/stat``; NaN elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its waited-for descendants (torchrun and its ranks)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_variant(args, S: int, C: int) -> dict:
    """One ``torchrun --nproc_per_node C`` launch; progress printed as the ranks report steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(C), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), __file__, "--worker", "--seq", str(S), "--cp", str(C), *(
               f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
                   "steps", "threads", "layers", "hidden", "heads", "groups", "vocab", "mtp_steps", "device"))]
    if args.loss:
        cmd.append(f"--loss={args.loss}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    load0, t0, busy0, own0 = os.getloadavg()[0], time.perf_counter(), _busy_cpu_s(), _own_cpu_s()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        ranks = {}
        for line in proc.stdout:
            if not line.startswith(TAG):
                continue
            msg = json.loads(line[len(TAG):])
            if "progress" in msg:
                if msg["rank"] == 0:
                    print(f"  S={S} C={C}: step {msg['progress']}/{args.steps} {msg['s']:.1f} s (rank 0)", flush=True)
            else:
                ranks[msg["rank"]] = msg
        rc = proc.wait()
        if rc != 0 or len(ranks) != C:
            err.seek(0)
            sys.exit(f"S={S} C={C} failed (torchrun exit {rc}):\n{err.read()[-4000:]}")
    res = summarise([ranks[r] for r in range(C)])
    res.update(load=(load0, os.getloadavg()[0]), wall_s=time.perf_counter() - t0)
    # The cores other processes used meanwhile: the machine's busy CPU time less this benchmark's
    # own (the load average lags by a minute and counts the previous variant's ranks).
    res["other_cores"] = max((_busy_cpu_s() - busy0) - (_own_cpu_s() - own0), 0.0) / res["wall_s"]
    warn = (f"  WARNING: other processes used {res['other_cores']:.2f} cores meanwhile, times not comparable"
            if res["other_cores"] > OTHER_CORES_LIMIT else "")
    print(f"  S={S} C={C}: {res['ms']:.0f} ms/step, peak {res['peak_mb']:.0f} MB/rank, {res['wall_s']:.0f} s in all, "
          f"load avg {res['load'][0]:.1f} -> {res['load'][1]:.1f}, other processes {res['other_cores']:.2f} cores{warn}",
          flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 65536, 131072], help="row lengths S (tokens)")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="context-parallel sizes C (C ranks each)")
    p.add_argument("--steps", type=int, default=3, help="steps per variant; the first is a warm-up (not timed)")
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64, help="hidden size (FFN 2x)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="query groups (GQA)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--mtp-steps", type=int, default=3, help="K (one MTP layer applied K times)")
    p.add_argument("--loss", default="", help="loss.type (default: the configuration's default)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dry-run", action="store_true",
                   help=f"tiny sizes ({', '.join(f'{k}={v}' for k, v in DRY.items())}): checks that everything runs; "
                        "rows recorded only where $BENCH_RESULTS_CSV is set")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.dry_run:
        vars(args).update(DRY)
    problem = check_args(args)
    if problem:
        sys.exit(f"error: {problem}")
    record = not args.dry_run or bool(os.environ.get("BENCH_RESULTS_CSV"))
    t_start = time.perf_counter()
    model = (f"layers={args.layers} hidden={args.hidden} heads={args.heads} groups={args.groups} vocab={args.vocab} "
             f"K={args.mtp_steps}")
    print(f"{model} loss={args.loss or 'default'} device={args.device} threads/rank={args.threads} "
          f"steps={args.steps} (first not timed) C={args.cp}", flush=True)
    base = min(args.cp)
    rows, failures = [], []
    for S in args.seq:
        res = {C: run_variant(args, S, C) for C in args.cp}
        ref = res[base]
        diffs = {C: loss_rel_diff(r["losses"], ref["losses"]) for C, r in res.items() if C != base}
        bad = [f"S={S} C={C}: losses {res[C]['losses']} vs C={base} {ref['losses']} (max rel diff {d:.2e})"
               for C, d in diffs.items() if not d <= REL_TOL]
        failures += bad
        rows.append((S, res, diffs))
        if bad or not record:
            continue
        import torch

        for C, r in res.items():
            params = {"S": S, "C": C, "threads_per_rank": r["threads"], "steps": args.steps,
                      **dict(x.split("=") for x in model.split())}
            metrics = {"step_ms": r["ms"], "peak_mb_per_rank": r["peak_mb"], "step_mb_per_rank": r["step_mb"],
                       "loss0": r["losses"][0], "load_before": r["load"][0], "load_after": r["load"][1],
                       "other_cores": r["other_cores"]}
            if C != base:
                metrics.update({f"time_ratio_c{base}": r["ms"] / ref["ms"],
                                f"peak_ratio_c{base}": r["peak_mb"] / ref["peak_mb"],
                                f"loss_rel_diff_c{base}": diffs[C]})
            append_results("bench_context_parallel", args.device, params, metrics, torch.__version__,
                           machine_extra=device_label(args.device))
    print()
    print("\n".join(table(rows, args.cp)))
    what = "the largest rank's peak resident set, VmHWM, of the whole process" if args.device == "cpu" else \
        "the largest rank's max_memory_allocated"
    print(f"(MB/rank: {what}; {time.perf_counter() - t_start:.0f} s)")
    if not record:
        print("dry run: rows not recorded (set BENCH_RESULTS_CSV to record them)")
    if failures:
        sys.exit("SELF-CHECK FAILED (those lengths not recorded): " + "; ".join(failures))


if __name__ == "__main__":
    main()
