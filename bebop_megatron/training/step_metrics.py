"""A training step's numbers: :class:`StepMetrics`, their one all-reduce across ranks, the
console lines, and the parameter counts of the run summary."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from bebop_megatron.training.loss import STAT_ROWS


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    top1: list[float]  # per MTP step, over valid chain positions: agreement with the data token
    ce: list[float]  # per MTP step (ce objective only; 0 otherwise)
    alpha_rs: list[float] = field(default_factory=list)  # mean sum_v min(p, q) per MTP step
    alpha_to: list[float] = field(default_factory=list)  # mean p(argmax q) per MTP step
    entropy_target: list[float] = field(default_factory=list)  # mean H(p)
    entropy_draft: list[float] = field(default_factory=list)  # mean H(q)
    kl: list[float] = field(default_factory=list)  # mean KL(p || q)
    # Expected accepted length E[L](g), g = 1..K: per position sum_{j<=g} prod_{i<=j} alpha_i,
    # averaged over the positions whose chain reaches g (rejection sampling / target-only).
    accept_len_rs: list[float] = field(default_factory=list)
    accept_len_to: list[float] = field(default_factory=list)
    # The decode-exact forecast E[L](g) (held-out pass only; empty otherwise): expected accepted
    # drafts over expected verifications on the held-out text (bebop_megatron.chain.decode_exact).
    accept_len_decode_rs: list[float] = field(default_factory=list)
    accept_len_decode_to: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    extra: dict = field(default_factory=dict)


def per_step(values) -> str:
    """One number per MTP step, for the console."""
    return " ".join(f"{v:.3f}" for v in values)


def reduce_step_metrics(
    outputs: list, grad_norm: torch.Tensor, *, num_steps: int, has_mtp: bool, comm_device: torch.device,
    step: int, lr: float,
) -> StepMetrics:
    """One all-reduce per step brings the logged numbers to every rank.

    Only one rank per data-parallel replica of the MTP stage contributes (its TP ranks
    hold copies of the same sums); every context-parallel rank contributes the sums of its
    own chunks of the rows. ``lr``: the LR the step's update used.
    """
    K, R = num_steps, len(STAT_ROWS)
    report = torch.zeros(3 + R * K)
    contributes = has_mtp and parallel_state.get_tensor_model_parallel_rank() == 0
    if contributes:
        for out in outputs:
            report[0] += out["loss_sum"].float().cpu()
            report[1] += out["count"].float().cpu()
            report[3:] += out["stats"].flatten().cpu()
        if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0:
            report[2] = grad_norm  # the same global norm on every rank: counted once
    report = report.to(comm_device)
    dist.all_reduce(report)
    report = report.cpu()
    rows = dict(zip(STAT_ROWS, report[3:].view(R, K)))
    count = rows["count"].clamp(min=1)
    mean = {name: (value / count).tolist() for name, value in rows.items()}
    decode = {}
    for which in ("rs", "to"):
        ver = rows[f"decode_verifications_{which}"]
        accepted = rows[f"decode_accepted_{which}"]
        decode[which] = (accepted / ver.clamp(min=1e-30)).tolist() if bool((ver > 0).all()) else []
    return StepMetrics(
        step=step,
        loss=float(report[0] / report[1].clamp(min=1)),
        grad_norm=float(report[2]),
        lr=lr,
        top1=mean["top1_correct"],
        ce=mean["ce_sum"],
        alpha_rs=mean["alpha_rs"],
        alpha_to=mean["alpha_to"],
        entropy_target=mean["entropy_target"],
        entropy_draft=mean["entropy_draft"],
        kl=mean["kl"],
        accept_len_rs=mean["accept_len_rs"],
        accept_len_to=mean["accept_len_to"],
        accept_len_decode_rs=decode["rs"],
        accept_len_decode_to=decode["to"],
    )


def eta_seconds(elapsed: float, *, step: int, start_step: int, steps: int) -> float:
    """Seconds left to ``steps``: ``elapsed`` (this process's loop time) covers only the steps
    done since ``start_step`` (the step the run resumed at, 0 for a fresh run)."""
    return elapsed / max(step - start_step, 1) * max(steps - step, 0)


def step_line(
    m: StepMetrics, elapsed: float, *, steps: int, loss_type: str, skipped_total: int, start_step: int = 0,
) -> str:
    """The console line of a training step (``elapsed``: seconds since the loop started at
    ``start_step``)."""
    eta = eta_seconds(elapsed, step=m.step, start_step=start_step, steps=steps)
    return (
        f"step {m.step:>5}/{steps} | {loss_type} {m.loss:.4f} | alpha_RS [{per_step(m.alpha_rs)}] | "
        f"E[L] {m.accept_len_rs[-1]:.2f} | top1 [{per_step(m.top1)}] | H(p) {m.entropy_target[0]:.2f} | "
        f"grad_norm {m.grad_norm:.3f} | "
        f"lr {m.lr:.2e} | {m.tokens_per_s:,.0f} tok/s | "
        + (f"MFU {m.extra['mfu']:.1%} | " if m.extra.get("mfu") is not None else "")
        + (f"mem {m.extra['peak_mem_gib']:.2f} GiB | " if "peak_mem_gib" in m.extra else "")
        + (f"skipped {skipped_total} | " if skipped_total else "")
        + f"ETA {eta:.0f}s"
    )


def eval_line(m: StepMetrics, seconds: float, *, loss_type: str) -> str:
    """The console line of an evaluation pass."""
    return (
        f"eval  {m.step:>5} | {m.extra['rows']} rows | {loss_type} {m.loss:.4f} | "
        f"alpha_RS [{per_step(m.alpha_rs)}] | alpha_TO [{per_step(m.alpha_to)}] | "
        f"E[L] RS [{per_step(m.accept_len_rs)}] TO [{per_step(m.accept_len_to)}] | "
        + (f"decode-exact E[L] RS [{per_step(m.accept_len_decode_rs)}] TO [{per_step(m.accept_len_decode_to)}] | "
           if m.accept_len_decode_rs else "")
        + f"top1 [{per_step(m.top1)}] | H(p) {m.entropy_target[0]:.2f} | {seconds:.1f}s"
    )


def count_parameters(model) -> tuple[int, int]:
    """This rank's share of the (total, trainable) parameter counts: summed over all ranks
    it gives the model size, each weight counted once (no TP/DP/expert-DP replicas, no MTP
    stage copy of the embedding)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    module = getattr(model, "module", model)
    dense_owner = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_owner = parallel_state.get_expert_data_parallel_rank() == 0
    total = trainable = 0
    for name, param in module.named_parameters():
        is_expert = getattr(param, "allreduce", True) is False
        if not (expert_owner if is_expert else dense_owner):
            continue
        if not param_is_not_tensor_parallel_duplicate(param):
            continue
        if name.startswith("embedding.") and not module.pre_process:
            continue  # the last stage's embedding copy (for MTP inputs) is not a new weight
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return total, trainable
