"""``benchmark_tv_loss.py --impls``: the fused loss's implementations against the projection GEMMs.

Legend: K MTP steps, T tokens, H hidden, V vocabulary. See ``benchmark_tv_loss.py``'s docstring.
"""

from __future__ import annotations

import contextlib
import statistics
import time

from common import PeakRSS, append_results, device_label
from loss_inputs import inputs


def _inputs(args, torch, device, dtype):
    draft, backbone, weight, valid = inputs(args)  # float32, CPU, from the same seed
    draft = draft.detach().to(device, dtype).requires_grad_(True)
    return draft, backbone.to(device, dtype), weight.to(device, dtype), valid.to(device)


def compare_impls(args) -> None:
    import torch

    from bebop_megatron.losses import fused_linear_objective

    device, dtype = args.device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    draft, backbone, weight, valid = _inputs(args, torch, device, dtype)
    K, T, _, H = draft.shape

    def gemms():  # the projections any implementation runs (forward logits, input gradient)
        with torch.no_grad():
            z_TV = backbone[:, 0] @ weight.t()
            q_KTV = draft[:, :, 0].reshape(K * T, H) @ weight.t()
            g_KTH = q_KTV @ weight
        return z_TV, g_KTH

    def fused(impl):
        def step():
            draft.grad = None
            loss = fused_linear_objective("e2e_tv", draft, backbone, weight, valid,
                                          chunk_tokens=args.chunk_tokens, impl=impl)
            loss.backward()
            return loss
        return step

    variants = {"gemm": gemms} | {impl: fused(impl) for impl in args.impls.split(",")}
    res = {}
    for name, fn in variants.items():
        times, mem = [], 0.0
        for i in range(args.warmup + args.iters):
            draft.grad = None
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            with contextlib.nullcontext() if cuda else PeakRSS() as rss:
                t0 = time.perf_counter()
                out = fn()
                sync()
                elapsed = time.perf_counter() - t0
            extra = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else rss.extra_mb
            if i >= args.warmup:
                times.append(elapsed)
                mem = max(mem, extra)
        res[name] = {"ms": 1e3 * statistics.median(times), "mem_mb": mem}
        if name != "gemm":
            res[name] |= {"loss": float(out.detach()), "grad": draft.grad.float().clone()}
        del out

    profiles = {}
    if getattr(args, "profile", False):  # one more step each, under the profiler
        from loss_profile import profile_step, report

        for name, fn in variants.items():
            profiles[name] = profile_step(torch, fn, cuda)

    gemm_ms = res["gemm"]["ms"]
    label = device_label(device)
    print(f"K={K} T={T} H={H} V={weight.shape[0]} {args.dtype} chunk_tokens={args.chunk_tokens} device={label} "
          f"warmup={args.warmup} iters={args.iters}")
    print(f"{'variant':<10}{'ms':>10}{'peak extra MB':>15}{'/ GEMM time':>13}{'loss':>12}")
    for name, r in res.items():
        loss = f"{r['loss']:.6f}" if "loss" in r else "-"
        print(f"{name:<10}{r['ms']:>10.2f}{r['mem_mb']:>15.0f}{r['ms'] / gemm_ms:>13.2f}{loss:>12}")
    impls = [n for n in res if n != "gemm"]
    metrics = {"gemm_ms": gemm_ms, "gemm_mem_mb": res["gemm"]["mem_mb"]}
    for name in impls:
        metrics |= {f"{name}_ms": res[name]["ms"], f"{name}_mem_mb": res[name]["mem_mb"],
                    f"{name}_over_gemm": res[name]["ms"] / gemm_ms}
    for name, (per_group, ops) in profiles.items():
        metrics |= report(name, per_group, ops)
    if K * T * weight.shape[0] <= 2**24:  # small enough for the float64 reference (the dry run's size)
        from bebop_megatron.losses import reference

        d, z, w = (t.detach().cpu().double() for t in (draft, backbone, weight))
        z_TV = torch.cat([z[:, 0] @ w.t(), z.new_zeros(K, w.shape[0])])  # step k's target: the logits at t + k
        target = torch.stack([z_TV[k + 1:k + 1 + T] for k in range(K)])
        ref = float(reference.objective("e2e_tv", d[:, :, 0] @ w.t(), target, valid[:, :, 0].cpu()))
        for name in impls:
            metrics[f"{name}_loss_abs_diff_float64"] = abs(res[name]["loss"] - ref)
        print(f"float64 reference loss {ref:.6f}: |diff| " + "  ".join(
            f"{n} {metrics[n + '_loss_abs_diff_float64']:.2e}" for n in impls))
    if len(impls) > 1:
        a, b = res[impls[0]], res[impls[1]]
        loss_diff = abs(a["loss"] - b["loss"])
        grad_diff = float((a["grad"] - b["grad"]).abs().max() / b["grad"].abs().max().clamp(min=1e-30))
        print(f"{impls[1]} / {impls[0]}: time {b['ms'] / a['ms']:.3f}, peak memory "
              f"{b['mem_mb'] / max(a['mem_mb'], 1e-9):.3f}; |loss diff| {loss_diff:.2e}, "
              f"max |grad diff| / max |grad| {grad_diff:.2e}")
        metrics |= {f"loss_abs_diff_{impls[1]}_{impls[0]}": loss_diff, f"grad_rel_diff_{impls[1]}_{impls[0]}": grad_diff}
    append_results("benchmark_tv_loss_impls", device,
                   {"K": K, "T": T, "H": H, "V": weight.shape[0], "dtype": args.dtype,
                    "chunk_tokens": args.chunk_tokens}, metrics, torch.__version__, machine_extra=label)
