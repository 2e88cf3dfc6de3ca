"""PP=2 part of ``bench_frozen_step.py``: the frozen-backbone pipeline against its ideal and 1F1B.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_frozen_step.py --pp 2 [--iters 8] [--warmup 2]

Two layouts of the same model (``--layers`` L), each as two ranks (gloo, one process per rank,
``OMP_NUM_THREADS=1`` each): ``balanced`` (L/2 layers per stage, the MTP block on stage 1 with
the last L/2) and ``standalone`` (``Et*L|m*KL``: every decoder layer on stage 0, stage 1 holds
only the MTP block and the loss). Per layout two variants:

  F  the method: Trainer.forward_backward (forward-only backbone pipeline, MTP fwd/bwd on the
     last stage, nothing sent backwards) + Trainer.optimizer_step, model.freeze_backbone=true.
  b  stock Megatron 1F1B (forward_backward_pipelining_without_interleaving, finalize_model_grads)
     with the same layout and model.freeze_backbone=false, then the optimizer step on each stage.

Each rank times its step (``wall``), the forward/backward part (``fb``), the optimizer part
(``opt``) and the time spent inside Megatron's ``P2PCommunicator`` send/recv calls (``p2p``:
waiting for the other stage plus the transfer). Per stage, busy = fb - p2p (+ opt where the
stage owns trainable parameters); the step time T is the slower rank's wall time; bubble =
T - busy. The ideal of F from the measured per-stage times, per micro-batch t0 = busy_0 / M
(backbone forward) and t1 = busy_1 / M (stage-1 backbone forward + MTP forward/backward + loss),
is a two-stage flow with M micro-batches plus the optimizer step o on the MTP stage:
``ideal = t0 + t1 + (M - 1) * max(t0, t1) + o``, per step (each step's T against the ideal from
that step's own stage times, so both saw the same machine load); F / ideal is the median of
those per-step ratios (the ratio of the two medians is printed too). Target: F / ideal <= 1.15.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

from common import Worker, append_results, free_port, reply, rss_mb

K = 3
VARIANTS = (("F", "balanced"), ("b", "balanced"), ("F", "standalone"), ("b", "standalone"))


def overrides(args, freeze: bool, micro_batch: int = 4, global_batch: int = 4) -> list[str]:
    """The benchmark's model and run (bench_frozen_step.py's PP=1 variants use it too)."""
    ffn = -(-args.hidden * 11 // 4 // 64) * 64  # 704 for hidden 256
    return [
        f"device={args.device}", "save.dir=null", "train.resume=none",
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={ffn}",
        "model.num_attention_heads=8", "model.num_query_groups=4", "model.vocab_size=2048",
        f"model.freeze_backbone={str(freeze).lower()}", "mtp.num_layers=1", f"mtp.num_steps={K}", f"loss.type={args.loss}",
        f"train.seq_length={args.seq}", f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={global_batch}",
        f"train.steps={args.warmup + args.iters}",
    ]


def pp_overrides(args, variant: str, layout: str) -> list[str]:
    out = [*overrides(args, variant == "F", args.micro_batch, args.global_batch), "parallel.pipeline=2"]
    if layout == "standalone":
        out.append(f"parallel.pipeline_layout=Et*{args.layers}|m*{K}L")
    return out


def _time_p2p(totals: list) -> None:
    """Accumulate the wall time spent in P2PCommunicator's public send/recv methods (outermost
    call only), in this benchmark process."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    depth = [0]

    def timed(method):
        @functools.wraps(method)
        def wrapper(*a, **k):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    totals[0] += time.perf_counter() - t0
        return wrapper

    for name in dir(P2PCommunicator):
        if name.startswith(("send_", "recv_")):
            setattr(P2PCommunicator, name, timed(getattr(P2PCommunicator, name)))


def pp_worker(args) -> None:
    import torch
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from bebop_megatron.config import load_config
    from bebop_megatron.training import Trainer

    p2p = [0.0]
    _time_p2p(p2p)
    cfg = load_config(overrides=pp_overrides(args, args.worker, args.layout))
    mem0 = rss_mb()
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    batches = next(trainer.batches())  # the same micro-batches every step
    model = trainer.model.module
    mem_built = rss_mb()
    stock = args.worker == "b"
    if stock:  # Megatron's own gradient finalisation (DP, embedding-group, per-token scaling)
        trainer.model.config.finalize_model_grads_func = finalize_model_grads
    forward_step_func = trainer.forward_step_func()
    trainable = any(p.requires_grad for p in model.parameters())

    def step():
        p2p[0] = 0.0
        t0 = time.perf_counter()
        if stock:
            trainer.model.zero_grad_buffer()
            trainer.optimizer.zero_grad()
            outs = forward_backward_pipelining_without_interleaving(
                forward_step_func=forward_step_func, data_iterator=iter(batches), model=[trainer.model],
                num_microbatches=len(batches), seq_length=cfg.train.seq_length,
                micro_batch_size=cfg.train.micro_batch_size)
        else:
            outs = trainer.forward_backward(batches)
        t1 = time.perf_counter()
        if stock:
            _, norm, _ = trainer.optimizer.step()
            trainer.scheduler.step(increment=1)
        else:
            norm = trainer.optimizer_step()
        t2 = time.perf_counter()
        loss = None
        if outs:
            loss = sum(float(o["loss_sum"]) for o in outs) / max(sum(int(o["count"]) for o in outs), 1)
        return {"wall": t2 - t0, "fb": t1 - t0, "opt": t2 - t1, "p2p": p2p[0], "loss": loss,
                "norm": float(norm or 0.0)}

    reply({"ready": True})
    for line in sys.stdin:
        if line.strip() != "step":
            break
        reply(step())
    reply({"mem_mb": max(rss_mb(peak=True) - mem_built, 0.0), "build_mb": mem_built - mem0,
           "threads": torch.get_num_threads(), "trainable": trainable, "torch": torch.__version__,
           "num_layers_here": len(model.decoder.layers), "has_mtp": trainer.has_mtp})


# ------------------------------------------------------------------ driver


def worker_cmd(args, *which: str) -> list[str]:
    """bench_frozen_step.py's command line of one worker (PP=1: ``--worker V``; PP=2: and ``--pp 2 --layout L``)."""
    return [sys.executable, args.script, *which, *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "warmup", "iters", "layers", "hidden", "seq", "device", "loss", "micro_batch", "global_batch"))]


def run_pp(args) -> dict:
    """Every variant's two ranks step together; variants take turns (rotating order)."""
    groups = {}
    for variant, layout in VARIANTS:
        port = str(free_port())
        groups[(variant, layout)] = [
            Worker(f"{variant}/{layout} rank {r}", worker_cmd(args, "--pp=2", f"--worker={variant}", f"--layout={layout}"),
                   env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
            for r in range(2)]
    try:
        for ranks in groups.values():
            for w in ranks:
                w.read()
        keys = list(groups)
        steps = {key: [] for key in keys}
        for r in range(args.warmup + args.iters):
            for key in keys[r % len(keys):] + keys[: r % len(keys)]:
                for w in groups[key]:
                    w.send("step")
                steps[key].append([w.read() for w in groups[key]])
        res = {}
        for key in keys:
            ends = [w.ask("end") for w in groups[key]]
            res[key] = summarise(steps[key][args.warmup:], ends, args.global_batch // args.micro_batch)
            res[key]["loss0"] = steps[key][0][1]["loss"]
            res[key]["grad_norm0"] = steps[key][0][1]["norm"]
        return res
    finally:
        for ranks in groups.values():
            for w in ranks:
                w.close()


def summarise(timed: list, ends: list, M: int) -> dict:
    """Medians over the timed steps of the step time, per-stage busy and bubble times, the ideal."""
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731  (ms)
    T = [max(s[0]["wall"], s[1]["wall"]) for s in timed]
    busy = [[s[r]["fb"] - s[r]["p2p"] + (s[r]["opt"] if ends[r]["trainable"] else 0.0) for s in timed]
            for r in range(2)]
    ideal = []
    for s in timed:
        t0 = (s[0]["fb"] - s[0]["p2p"]) / M
        t1 = (s[1]["fb"] - s[1]["p2p"]) / M
        ideal.append(t0 + t1 + (M - 1) * max(t0, t1) + s[1]["opt"])
    return {
        "step_ms": med(T), "ideal_ms": med(ideal), "ratio_ideal": statistics.median(t / i for t, i in zip(T, ideal)),
        "busy_ms": [med(b) for b in busy], "bubble_ms": [med([t - x for t, x in zip(T, b)]) for b in busy],
        "p2p_ms": [med([s[r]["p2p"] for s in timed]) for r in range(2)],
        "opt_ms": [med([s[r]["opt"] for s in timed]) for r in range(2)],
        "mem_mb": [e["mem_mb"] for e in ends], "layers": [e["num_layers_here"] for e in ends],
        "trainable": [e["trainable"] for e in ends], "threads": ends[0]["threads"], "torch": ends[0]["torch"],
    }


def report_pp(args, res: dict, loads: tuple[float, float]) -> list[str]:
    """Print the table; return the self-check failures (empty when the variants agree)."""
    verdict = {True: "PASS", False: "MISS"}.get
    M = args.global_batch // args.micro_batch
    print(f"PP=2 L={args.layers} hidden={args.hidden} seq={args.seq} K={K} micro-batch={args.micro_batch} "
          f"M={M} loss={args.loss} device={args.device} threads/rank={res[VARIANTS[0]]['threads']} "
          f"warmup={args.warmup} iters={args.iters} load avg {loads[0]:.1f} -> {loads[1]:.1f}")
    print(f"{'variant':<26}{'layers':>8}{'step ms':>9}{'ideal ms':>9}{'busy ms s0/s1':>16}{'bubble ms s0/s1':>17}"
          f"{'p2p ms s0/s1':>15}{'mem MB s0/s1':>15}")
    names = {"F": "F frozen pipeline", "b": "b 1F1B, trainable"}
    for (v, layout), r in res.items():
        pair = lambda xs: f"{xs[0]:.0f}/{xs[1]:.0f}"  # noqa: E731
        ideal = f"{r['ideal_ms']:.0f}" if v == "F" else "-"
        print(f"{names[v] + ' ' + layout:<26}{pair(r['layers']):>8}{r['step_ms']:>9.0f}{ideal:>9}"
              f"{pair(r['busy_ms']):>16}{pair(r['bubble_ms']):>17}{pair(r['p2p_ms']):>15}{pair(r['mem_mb']):>15}")
    for layout in ("balanced", "standalone"):
        F, b = res[("F", layout)], res[("b", layout)]
        print(f"{layout:>10}: F / ideal = {F['ratio_ideal']:.3f} (target <= 1.15) {verdict(F['ratio_ideal'] <= 1.15)}"
              f" (median of per-step ratios; ratio of the medians {F['step_ms'] / F['ideal_ms']:.3f});"
              f"  F / 1F1B = {F['step_ms'] / b['step_ms']:.3f};  F bubble per stage "
              f"{F['bubble_ms'][0] / F['step_ms']:.0%} / {F['bubble_ms'][1] / F['step_ms']:.0%} of the step")
    losses = {f"{v}/{layout}": r["loss0"] for (v, layout), r in res.items()}
    # Initial weights depend on the layout (the MTP layer's RNG draws follow the stage's decoder
    # layers), so F and 1F1B are compared within a layout.
    print("first-step loss " + "  ".join(f"{k}={x:.6f}" for k, x in losses.items()) + " (F and b agree per layout)")
    return [f"b/{layout} first-step loss {losses['b/' + layout]:.6f} != F/{layout} {losses['F/' + layout]:.6f}"
            for layout in ("balanced", "standalone")
            if abs(losses["b/" + layout] - losses["F/" + layout]) > 1e-4 * max(abs(losses["F/" + layout]), 1)]


def main_pp(args) -> None:
    if args.worker:
        return pp_worker(args)
    if args.global_batch % args.micro_batch:
        sys.exit("error: --global-batch must be a multiple of --micro-batch")
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    res = run_pp(args)
    loads = (load0, os.getloadavg()[0])
    failures = report_pp(args, res, loads)
    if max(loads) > (os.cpu_count() or 1):
        print(f"WARNING: load average above {os.cpu_count()} CPUs: other processes compete, wall times are unreliable")
    if failures:
        sys.exit("SELF-CHECK FAILED (no results recorded): " + "; ".join(failures))
    for layout in ("balanced", "standalone"):
        F, b = res[("F", layout)], res[("b", layout)]
        params = {"layers": args.layers, "hidden": args.hidden, "seq": args.seq, "K": K, "pp": 2, "layout": layout,
                  "micro_batch": args.micro_batch, "global_batch": args.global_batch, "loss": args.loss}
        metrics = {"step_F_ms": F["step_ms"], "ideal_F_ms": F["ideal_ms"], "ratio_F_ideal": F["ratio_ideal"],
                   "ratio_F_ideal_of_medians": F["step_ms"] / F["ideal_ms"],
                   "step_1f1b_ms": b["step_ms"], "ratio_F_1f1b": F["step_ms"] / b["step_ms"]}
        for name, r in (("F", F), ("1f1b", b)):
            for s in range(2):
                metrics[f"bubble_{name}_stage{s}_ms"] = r["bubble_ms"][s]
                metrics[f"busy_{name}_stage{s}_ms"] = r["busy_ms"][s]
        metrics |= {"load_avg_start": loads[0], "load_avg_end": loads[1]}
        if args.note:
            metrics["note"] = args.note
        append_results("bench_frozen_step", args.device, params, metrics, F["torch"])
    print(f"({time.perf_counter() - t_start:.0f} s)")
