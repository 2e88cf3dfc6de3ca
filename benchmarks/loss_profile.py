"""``benchmark_tv_loss.py --impls ... --profile``: where one step of the fused loss spends its time.

One forward + backward per implementation under ``torch.profiler`` (after the timed steps, so
nothing is compiled or allocated for the first time), its kernels (CUDA) or operators (CPU)
put in four groups by name:

- ``gemm``: matrix products (``mm``, ``matmul``, ``addmm``, cuBLAS / CUTLASS / nvjet kernels):
  the backbone logits, the K draft logits and the gradient projection;
- ``triton``: the Triton kernels of ``bebop_megatron/losses/kernel_triton.py``;
- ``reduce``: reductions (max, sum, logsumexp, softmax statistics);
- ``elementwise``: the rest (exp, min, casts, copies, fills).

Printed: the share of self time per group and the top operations; appended as metrics
``<impl>_prof_<group>_ms`` and ``<impl>_prof_gemm_share``. On the GPU this answers which part
of the fused loss to attack first (issue: at most 1.3x the projection GEMMs).
"""

from __future__ import annotations

GROUPS = ("gemm", "triton", "reduce", "elementwise")
_GEMM = ("gemm", "matmul", "addmm", "bmm", "aten::mm", "cutlass", "nvjet", "xmma", "sm90_", "cublas")
_TRITON = ("_kernel",)  # the Triton kernels' names end in _kernel (e.g. parts_kernel)
_REDUCE = ("max", "sum", "logsumexp", "softmax", "reduce", "amax", "norm")


def group_of(name: str) -> str:
    low = name.lower()
    if any(k in low for k in _GEMM):
        return "gemm"
    if low.startswith("_") and any(low.endswith(k) for k in _TRITON):
        return "triton"
    if any(k in low for k in _REDUCE):
        return "reduce"
    return "elementwise"


def profile_step(torch, step, cuda: bool, top: int = 8) -> tuple[dict, list]:
    """``(ms per group, top [(name, ms)])`` of one call of ``step`` (self time of the leaf
    kernels on CUDA, of the operators on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    per_group = dict.fromkeys(GROUPS, 0.0)
    ops = []
    for event in prof.key_averages():
        if cuda:
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = getattr(event, "self_cuda_time_total", 0.0)
            if not us or event.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            us = event.self_cpu_time_total
            if not us or event.key.startswith(("ProfilerStep", "autograd::engine")):
                continue
        per_group[group_of(event.key)] += us / 1e3
        ops.append((event.key, us / 1e3))
    ops.sort(key=lambda kv: -kv[1])
    return per_group, ops[:top]


def report(name: str, per_group: dict, ops: list) -> dict:
    """Print one implementation's breakdown; returns its metrics."""
    total = sum(per_group.values()) or float("nan")
    shares = "  ".join(f"{g} {per_group[g]:.1f} ms ({per_group[g] / total:.0%})" for g in GROUPS)
    print(f"profile {name}: {total:.1f} ms of kernels: {shares}")
    for op, ms in ops:
        print(f"    {ms:9.2f} ms  {group_of(op):<11} {op[:90]}")
    metrics = {f"{name}_prof_{g}_ms": per_group[g] for g in GROUPS}
    metrics[f"{name}_prof_gemm_share"] = per_group["gemm"] / total
    return metrics
