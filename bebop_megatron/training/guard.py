"""Numerics guard: a step with a non-finite loss or gradient is skipped, not applied.

Megatron's bf16/fp32 optimizers apply whatever gradient they get (only fp16's loss scaler
checks for inf/nan), so one bad batch would turn every MTP weight into NaN. The trainer
computes the global gradient norm before the update (once per step: Megatron's clipping reuses
it, :mod:`bebop_megatron.platform.grad_norms`), agrees with every rank on one flag, and skips
the update when the loss or the norm is not finite. ``train.max_skipped_steps``
consecutive skips mean the run itself diverged: it stops with :class:`NumericsError`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


NUMERICS_EXIT_CODE = 3


class NumericsError(RuntimeError):
    """Too many consecutive non-finite steps; the CLI prints it on one line and exits with 3."""

    exit_code = NUMERICS_EXIT_CODE
    same_on_every_rank = True  # the ranks agree on every skip: rank 0 alone reports it


def agree_on_flags(*flags: bool, device: torch.device) -> list[bool]:
    """Logical OR of each flag over all ranks (one all-reduce)."""
    tensor = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.cpu()]


def local_loss_is_finite(outputs: list) -> bool:
    """True when every micro-batch loss this rank computed is finite (backbone stages: True)."""
    return all(bool(torch.isfinite(out["loss_sum"]).all()) for out in outputs)


class NumericsGuard:
    """Counts skipped steps; raises :class:`NumericsError` after ``max_consecutive`` in a row."""

    def __init__(self, max_consecutive: int, total: int = 0):
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = total

    def record(self, skipped: bool, step: int) -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.max_consecutive:
            raise NumericsError(
                f"step {step}: {self.consecutive} consecutive steps with a non-finite loss or gradient "
                f"(train.max_skipped_steps={self.max_consecutive}, {self.total} skipped in all); "
                "the run diverged: lower train.lr, use precision=fp32, or check the data; "
                "train.resume=auto restarts from the latest checkpoint"
            )
