"""Frozen-backbone MTP step vs its ideal lower bound and vs a fully trainable step.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_frozen_step.py [--iters 10] [--warmup 2]
        [--layers 12] [--hidden 256] [--seq 256] [--loss e2e_tv] [--device cpu|cuda]
    .venv/bin/python benchmarks/bench_frozen_step.py --pp 2     # PP=2, two layouts: frozen_pipeline.py

Each variant runs in its own subprocess (one Trainer per process: it initialises
torch.distributed and Megatron's parallel state), which answers in JSON on stdout. All three
compute the same objective (``--loss``, default e2e_tv, the trainer's mtp_loss, which also
computes the backbone logits) from the same weights and data:

  F  the method: Trainer.forward_backward + Trainer.optimizer_step, model.freeze_backbone=true.
  a  ideal lower bound from the same frozen model's modules: backbone forward under no_grad
     (embedding, decoder, final norm), then the model's MTP post-process on those hidden
     states, mtp_loss, backward, finalize_mtp_grads and the SAME optimizer step.
  b  model.freeze_backbone=false (all parameters trainable), same calls as F.

Self-check: the first-step losses of F, a and b and the grad norms of F and a must agree;
otherwise the script exits with status 1 and records nothing.
Time: median wall time per step over --iters after --warmup steps (same batch each step); the
three processes stay alive and the driver interleaves their steps (F, a, b, then a, b, F,
...), so a change of machine load during the run hits all three alike.
Peak memory, CPU: ru_maxrss after the timed steps minus the current RSS just after the
Trainer was built; CUDA: max_memory_allocated (reset after the build) minus the memory
allocated then. One row per run is appended to benchmarks/results.csv; see README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Worker, append_results, reply, rss_mb  # noqa: E402
from frozen_pipeline import K, main_pp, overrides, worker_cmd  # noqa: E402


# ------------------------------------------------------------------ worker (one variant)


def worker(args) -> None:
    import torch
    from megatron.core import parallel_state

    from bebop_megatron.config import load_config
    from bebop_megatron.data import attention_mask
    from bebop_megatron.training import Trainer
    from bebop_megatron.training.loss import mtp_loss
    from bebop_megatron.training.optim import finalize_mtp_grads

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mem = (lambda: torch.cuda.memory_allocated() / 2**20) if cuda else rss_mb
    cfg = load_config(overrides=overrides(args, freeze=args.worker != "b"))
    mem0 = mem()
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    batches = next(trainer.batches())  # the same micro-batches every step
    if cuda:
        batches = [type(b)(*(t.cuda() for t in vars(b).values())) for b in batches]
    model = trainer.model.module  # MTPGPTModel inside Megatron's DDP
    tp_group = parallel_state.get_tensor_model_parallel_group()
    mem_built = mem()
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step_f() -> tuple[dict, float, float]:
        t0 = time.perf_counter()
        outs = trainer.forward_backward(batches)
        sync()
        t1 = time.perf_counter()
        norm = trainer.optimizer_step()
        sync()
        parts = {"fwd_bwd": t1 - t0, "opt": time.perf_counter() - t1}
        return parts, sum(float(o["loss_sum"]) for o in outs) / max(sum(int(o["count"]) for o in outs), 1), float(norm)

    def step_a() -> tuple[dict, float, float]:
        (batch,) = batches  # micro-batch = global batch: one micro-batch, no no_sync needed
        mask = attention_mask(batch.segment_ids)  # None unless rows are packed, as in F
        t0 = time.perf_counter()
        with torch.no_grad():
            dec_in, rope, cos, sin, offset, _ = model._preprocess(batch.tokens, batch.position_ids)[:6]
            hidden = model.decoder(hidden_states=dec_in, attention_mask=mask, rotary_pos_emb=rope,
                                   rotary_pos_cos=cos, rotary_pos_sin=sin, sequence_len_offset=offset)
            sync()
        t1 = time.perf_counter()
        trainer.model.zero_grad_buffer()  # as Trainer.forward_backward does
        trainer.optimizer.zero_grad()
        # The model's own MTP post-process (MTP block, per-step norms): [(1+K)*S, B, H].
        out = model._postprocess(hidden, batch.tokens, batch.position_ids, None, rope, cos, sin,
                                 mtp_in_postprocess=True, attention_mask=mask, sequence_len_offset=offset)
        # The trainer's loss (cfg.loss): the backbone logits are computed inside it, as in F and b.
        loss_sum, count, _ = mtp_loss(model, out, batch, K, tp_group, cfg.loss, vocab_size=cfg.model.vocab_size)
        trainer.optimizer.scale_loss(loss_sum).backward()
        finalize_mtp_grads([trainer.model], count.clone())  # DP sync + per-token scaling, as F
        sync()
        t2 = time.perf_counter()
        norm = trainer.optimizer_step()
        sync()
        parts = {"backbone": t1 - t0, "mtp_fwd_bwd": t2 - t1, "opt": time.perf_counter() - t2}
        return parts, float(loss_sum.detach()) / max(int(count), 1), float(norm)

    step = step_a if args.worker == "a" else step_f
    reply({"ready": True})
    for line in sys.stdin:  # the driver interleaves the variants' steps: "step" ... "end"
        if line.strip() != "step":
            break
        c0 = time.process_time()
        parts, loss, norm = step()
        reply({"parts": parts, "cpu": time.process_time() - c0, "loss": loss, "norm": norm})
    sync()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb(peak=True)
    reply({"mem_mb": max(peak - mem_built, 0.0), "build_mb": mem_built - mem0, "threads": torch.get_num_threads(),
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad), "torch": torch.__version__})


# ------------------------------------------------------------------ driver


def run_all(args) -> dict:
    """Interleaved: every round runs one step of each variant (rotating the order)."""
    workers = [Worker(v, worker_cmd(args, "--worker", v)) for v in ("F", "a", "b")]
    try:
        for w in workers:
            w.read()  # "ready": Trainer built
        steps = {w.name: [] for w in workers}
        for r in range(args.warmup + args.iters):
            for w in workers[r % 3:] + workers[: r % 3]:
                steps[w.name].append(w.ask("step"))
        res = {}
        for w in workers:
            timed = steps[w.name][args.warmup:]
            res[w.name] = w.ask("end") | {
                "step_ms": 1e3 * statistics.median(sum(t["parts"].values()) for t in timed),
                "min_ms": 1e3 * min(sum(t["parts"].values()) for t in timed),
                "cpu_ms": 1e3 * statistics.median(t["cpu"] for t in timed),
                "parts_ms": {k: 1e3 * statistics.median(t["parts"][k] for t in timed) for k in timed[0]["parts"]},
                "loss0": steps[w.name][0]["loss"], "grad_norm0": steps[w.name][0]["norm"],
            }
        return res
    finally:
        for w in workers:
            w.close()


def self_check(res: dict) -> list[str]:
    """F, a and b compute the same objective from the same weights and data: their first-step
    losses agree, and F and a (same trainable parameters) agree on the gradient norm."""
    F, a, b = res["F"], res["a"], res["b"]
    close = lambda x, y: abs(x - y) <= 1e-4 * max(abs(x), 1)  # noqa: E731
    out = [f"{v} first-step loss {r['loss0']:.6f} != F {F['loss0']:.6f}"
           for v, r in (("a", a), ("b", b)) if not close(r["loss0"], F["loss0"])]
    if not close(a["grad_norm0"], F["grad_norm0"]):
        out.append(f"a first-step grad norm {a['grad_norm0']:.6f} != F {F['grad_norm0']:.6f}")
    return out


def main() -> None:
    verdict = {True: "PASS", False: "MISS"}.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=10, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256, help="multiple of 8 (8 heads, 4 query groups)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--loss", default="e2e_tv", help="loss.type of every variant (default e2e_tv, the method)")
    p.add_argument("--pp", type=int, choices=(1, 2), default=1,
                   help="2: the PP=2 benchmark on 2 gloo ranks per variant (frozen_pipeline.py)")
    p.add_argument("--micro-batch", type=int, default=1, help="PP=2 only (PP=1: 4)")
    p.add_argument("--global-batch", type=int, default=8, help="PP=2 only (PP=1: 4, one micro-batch)")
    p.add_argument("--note", default="", help="free text recorded as a 'note' row (e.g. the machine's load)")
    p.add_argument("--worker", choices=("F", "a", "b"), help=argparse.SUPPRESS)
    p.add_argument("--layout", choices=("balanced", "standalone"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.warmup = max(args.warmup, 1)
    args.script = __file__
    if args.pp == 2:
        return main_pp(args)
    if args.worker:
        return worker(args)

    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    res = run_all(args)
    load1 = os.getloadavg()[0]
    F, a, b = res["F"], res["a"], res["b"]
    L = args.layers
    ideal = (L + 3 * K) / (3 * L + 3 * K)
    r_fa, r_fb = F["step_ms"] / a["step_ms"], F["step_ms"] / b["step_ms"]

    print(f"L={L} hidden={args.hidden} seq={args.seq} K={K} batch=4 loss={args.loss} device={args.device} "
          f"threads={F['threads']} warmup={args.warmup} iters={args.iters} load avg {load0:.1f} -> {load1:.1f}")
    print(f"{'variant':<34}{'step ms':>9}{'cpu ms':>9}{'mem MB':>9}{'build MB':>10}{'trainable':>12}  parts (median ms)")
    names = {"F": "F  frozen backbone (the method)", "a": "a  ideal: no_grad bb + MTP f/b", "b": "b  all trainable"}
    for v, r in res.items():
        parts = " ".join(f"{k}={x:.1f}" for k, x in r["parts_ms"].items())
        print(f"{names[v]:<34}{r['step_ms']:>9.1f}{r['cpu_ms']:>9.1f}{r['mem_mb']:>9.1f}{r['build_mb']:>10.1f}{r['trainable']:>12,}  {parts}")
    print(f"first-step loss  F={F['loss0']:.6f} a={a['loss0']:.6f} b={b['loss0']:.6f}; "
          f"grad norm F={F['grad_norm0']:.6f} a={a['grad_norm0']:.6f} (F and a must agree)")
    print(f"F / a = {r_fa:.3f}  (target <= 1.15) {verdict(r_fa <= 1.15)}")
    print(f"F / b = {r_fb:.3f}  ideal (L+3K)/(3L+3K) = {ideal:.3f}  deviation {100 * (r_fb / ideal - 1):+.1f}%  "
          f"(target within 10%) {verdict(abs(r_fb / ideal - 1) <= 0.10)}")
    print(f"peak memory F / b = {F['mem_mb']:.1f} / {b['mem_mb']:.1f} MB = {F['mem_mb'] / max(b['mem_mb'], 1e-9):.2f}  "
          f"(target <= 0.75) {verdict(F['mem_mb'] <= 0.75 * b['mem_mb'])}")
    for what, key in (("process CPU time", "cpu_ms"), ("fastest step (best of N)", "min_ms")):
        print(f"info, on {what}: F / a = {F[key] / a[key]:.3f}  F / b = {F[key] / b[key]:.3f}")
    layer_ms = a["parts_ms"]["backbone"] / L
    print(f"info, measured pass counts: backbone layer forward {layer_ms:.1f} ms; MTP step (fwd+bwd+loss) = "
          f"{a['parts_ms']['mtp_fwd_bwd'] / K / layer_ms:.2f} layer forwards (ideal 3); backbone backward "
          f"(b - F) / backbone forward = {(b['step_ms'] - F['step_ms']) / a['parts_ms']['backbone']:.2f} (ideal 2)")
    if max(load0, load1) > (os.cpu_count() or 1):
        print(f"WARNING: load average above {os.cpu_count()} CPUs: other processes compete, wall times are unreliable")
    failures = self_check(res)
    if failures:
        sys.exit("SELF-CHECK FAILED (no results recorded): " + "; ".join(failures))

    metrics = {"step_F_ms": F["step_ms"], "step_a_ms": a["step_ms"], "step_b_ms": b["step_ms"], "ratio_F_a": r_fa,
               "ratio_F_b": r_fb, "ideal_F_b": ideal, "mem_F_mb": F["mem_mb"], "mem_b_mb": b["mem_mb"],
               "load_avg_start": load0, "load_avg_end": load1}
    if args.note:
        metrics["note"] = args.note
    append_results("bench_frozen_step", args.device,
                   {"layers": L, "hidden": args.hidden, "seq": args.seq, "K": K, "loss": args.loss}, metrics, F["torch"])
    print(f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
