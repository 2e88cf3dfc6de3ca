"""The e2e TV loss fused with the output projection vs the naive autograd formula (and the
fused ce against Megatron's cross-entropy on full logits: ``--objective ce``).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/benchmark_tv_loss.py            # the issue's shape, ~10 min on 2 cores
    .venv/bin/python benchmarks/benchmark_tv_loss.py --tokens 256 --vocab 32000 --iters 2   # a quick look

Shape (defaults, the issue's): K=3 MTP steps, T=1024 tokens, H=2048, V=151,936 (the Qwen
vocabulary), float32, one rank. Inputs: the K draft hidden states ``[K, T, 1, H]``
(requires grad), the backbone hidden states ``[T, 1, H]`` and the output weight ``[V, H]``
(frozen), all positions valid except where t + k runs past the sequence.

Variants, each in its own process (inputs from the same seed):

  fused  ``fused_linear_objective("e2e_tv", ...)``: logits chunk by chunk
         (``--chunk-tokens``, default 512), backbone logits shared by the K steps,
         gradient computed during the forward.
  naive  the plain formula with full logits materialised, differentiated by autograd:
         z = h_backbone @ W.T once, step k's target is z[t + k] (a strided view, no copy),
         q = softmax(h_draft @ W.T), d = 1 - sum min(p, q), the e2e chain product.

One step = forward + backward (to the draft hidden states). Time: median over ``--iters``
steps after ``--warmup``, the two processes stepped alternately. Peak extra memory: the
highest RSS sampled during a step (every 2 ms) minus the RSS before it (inputs allocated,
previous gradient freed). The two variants' losses and gradients are compared.
Targets (PASS/MISS, e2e TV only): peak extra memory fused <= 1/8 naive; time fused <= 1.0 x
naive. Rows are appended to ``benchmarks/results.csv``.

``--objective ce``: the trainer's ``ce`` objective (the data tokens' cross-entropy, with the
acceptance statistics against the backbone, on random data tokens): ``fused`` is
``fused_linear_objective("ce", ...)`` (what ``loss.type=ce`` runs), ``naive`` what it ran
before (the statistics from the fused kernel without gradients, then Megatron's
``vocab_parallel_cross_entropy`` on the full draft logits, one rank)::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/benchmark_tv_loss.py --objective ce \
        --tokens 2048 --hidden 576 --vocab 49152     # SmolLM2-135M's H and V, 2 x 1,024 tokens

``--impls torch,triton``: instead, the fused loss's kernel implementations side by side in
one process (``impl=``; triton needs CUDA), on ``--device`` in ``--dtype``, against the
projection GEMMs every implementation must run (backbone logits ``[T, H] x [H, V]``, draft
logits ``[K T, H] x [H, V]`` and the gradient ``[K T, V] x [V, H]``, plain ``torch.matmul``
on the full tensors). Per implementation: median time of forward + backward, peak extra
memory (CUDA: ``max_memory_allocated`` over the step minus the allocation before it; CPU:
sampled RSS) and time / GEMM time. The GPU script runs it at K=3, T=8192, H=4096,
V=151,936, bf16 (``benchmarks/gpu/run_all.sh``, with ``--profile``: the share of each step's
kernel time in GEMMs, Triton kernels, reductions and elementwise work, ``loss_profile.py``)::

    python benchmarks/benchmark_tv_loss.py --impls torch,triton --device cuda --dtype bf16 \
        --tokens 8192 --hidden 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PeakRSS, Worker, append_results, reply  # noqa: E402
from loss_inputs import inputs, megatron_ce_loss, naive_loss  # noqa: E402


def worker(args) -> None:
    import torch

    from bebop_megatron.losses import fused_linear_objective

    torch.set_num_threads(os.cpu_count() or 1)
    draft, backbone, weight, valid = inputs(args)
    if args.objective == "ce":
        labels = torch.randint(0, args.vocab, (args.steps, args.tokens, 1), generator=torch.Generator().manual_seed(1))
        if args.worker == "naive":  # Megatron's cross-entropy needs its (one-rank) parallel state
            import torch.distributed as dist
            from megatron.core import parallel_state

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                    rank=0, world_size=1)
            parallel_state.initialize_model_parallel()

            def loss_fn():
                return megatron_ce_loss(draft, backbone, weight, valid, labels, args.chunk_tokens)
        else:
            def loss_fn():
                return fused_linear_objective("ce", draft, backbone, weight, valid, labels=labels,
                                              chunk_tokens=args.chunk_tokens, return_stats=True)[0]
    elif args.worker == "fused":
        def loss_fn():
            return fused_linear_objective("e2e_tv", draft, backbone, weight, valid, chunk_tokens=args.chunk_tokens)
    else:
        def loss_fn():
            return naive_loss(draft, backbone, weight, valid)
    reply({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        if line.strip() != "step":
            break
        draft.grad = None
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            loss = loss_fn()
            loss.backward()
            elapsed = time.perf_counter() - t0
        reply({"time": elapsed, "mem_mb": mem.extra_mb, "loss": float(loss),
               "grad_norm": float(draft.grad.double().norm()), "grad_head": draft.grad.flatten()[:4096].tolist()})


def main() -> None:
    verdict = {True: "PASS", False: "MISS"}.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="K, MTP steps")
    p.add_argument("--tokens", type=int, default=1024, help="T, tokens (sequence positions, batch 1)")
    p.add_argument("--hidden", type=int, default=2048, help="H")
    p.add_argument("--vocab", type=int, default=151936, help="V")
    p.add_argument("--chunk-tokens", type=int, default=512, help="loss.chunk_tokens of the fused variant")
    p.add_argument("--objective", choices=("e2e_tv", "ce"), default="e2e_tv",
                   help="ce: the fused ce against Megatron's cross-entropy on full logits (the statistics in both)")
    p.add_argument("--iters", type=int, default=3, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--impls", default="", help="e.g. torch,triton: compare the fused loss's implementations")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="--impls only")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="--impls only")
    p.add_argument("--profile", action="store_true",
                   help="--impls only: one more step each under torch.profiler, time by group (loss_profile.py)")
    p.add_argument("--worker", choices=("fused", "naive"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.impls:
        from loss_impls import compare_impls

        return compare_impls(args)
    if args.worker:
        return worker(args)

    t_start = time.perf_counter()
    shape = ["--steps", str(args.steps), "--tokens", str(args.tokens), "--hidden", str(args.hidden),
             "--vocab", str(args.vocab), "--chunk-tokens", str(args.chunk_tokens), "--objective", args.objective]
    workers = [Worker(v, [sys.executable, __file__, "--worker", v, *shape]) for v in ("fused", "naive")]
    try:
        info = [w.read() for w in workers]
        steps = {w.name: [] for w in workers}
        for r in range(args.warmup + args.iters):
            for w in workers[r % 2:] + workers[: r % 2]:
                steps[w.name].append(w.ask("step"))
                print(f"  {w.name:<5} step {r}: {steps[w.name][-1]['time']:.2f} s, "
                      f"+{steps[w.name][-1]['mem_mb']:.0f} MB", flush=True)
    finally:
        for w in workers:
            w.close()
    res = {}
    for name, runs in steps.items():
        timed = runs[args.warmup:] or runs
        res[name] = {"time": statistics.median(s["time"] for s in timed), "mem": max(s["mem_mb"] for s in runs),
                     "loss": runs[0]["loss"], "grad_norm": runs[0]["grad_norm"], "head": runs[0]["grad_head"]}
    f, n = res["fused"], res["naive"]
    t_ratio, m_ratio = f["time"] / n["time"], f["mem"] / max(n["mem"], 1e-9)
    max_diff = max(abs(a - b) for a, b in zip(f["head"], n["head"]))
    print(f"objective={args.objective} K={args.steps} T={args.tokens} H={args.hidden} V={args.vocab} float32 "
          f"chunk_tokens={args.chunk_tokens} "
          f"threads={info[0]['threads']} warmup={args.warmup} iters={args.iters}")
    print(f"{'variant':<8}{'fwd+bwd s':>11}{'peak extra MB':>15}{'loss':>12}{'grad norm':>14}")
    for name, r in res.items():
        print(f"{name:<8}{r['time']:>11.2f}{r['mem']:>15.0f}{r['loss']:>12.6f}{r['grad_norm']:>14.6e}")
    print(f"agreement: |loss diff| = {abs(f['loss'] - n['loss']):.2e}, max |grad diff| (first 4096) = {max_diff:.2e}")
    targets = args.objective == "e2e_tv"  # the targets are the fused e2e TV loss's (its issue's)
    print(f"time fused / naive = {t_ratio:.3f}" + (f"  (target <= 1.0) {verdict(t_ratio <= 1.0)}" if targets else ""))
    print(f"peak extra memory fused / naive = {m_ratio:.4f} = 1/{1 / max(m_ratio, 1e-9):.1f}"
          + (f"  (target <= 1/8) {verdict(m_ratio <= 1 / 8)}" if targets else ""))
    if args.objective == "ce":
        print("(ce: naive = the statistics without gradients + Megatron's vocab_parallel_cross_entropy on full logits)")
    params = {"objective": args.objective} if args.objective != "e2e_tv" else {}
    append_results(
        "benchmark_tv_loss", "cpu",
        {**params, "K": args.steps, "T": args.tokens, "H": args.hidden, "V": args.vocab, "chunk_tokens": args.chunk_tokens},
        {"fused_s": f["time"], "naive_s": n["time"], "time_ratio": t_ratio, "fused_mem_mb": f["mem"],
         "naive_mem_mb": n["mem"], "mem_ratio": m_ratio, "loss_abs_diff": abs(f["loss"] - n["loss"])},
        info[0]["torch"],
    )
    print(f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
