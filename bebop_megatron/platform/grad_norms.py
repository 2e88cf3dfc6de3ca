"""One gradient-norm pass per step: Megatron's optimizer step fed the norms the guard computed.

The numerics guard (:mod:`bebop_megatron.training.guard`) needs the global gradient norm
*before* the update, to skip a non-finite step. Megatron's ``ChainedOptimizer.step()`` then
runs ``prepare_grads()``, ``get_grad_norm()`` and, when clipping, ``_compute_grad_norms_by_group()``
again: a second reduction over every gradient (and, for the mixed-precision optimizers, a
second model-to-main gradient copy). :func:`step_with_norms` runs Megatron's own ``step()``
(clipping, separate grad-norm groups, skip threshold, zero counting, parameter update)
with those three methods answering from :class:`GradNorms` instead. Should a Megatron
version stop calling them, its step recomputes: slower, never wrong
(``tests/test_grad_norm_once.py`` counts the passes).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field


@dataclass
class GradNorms:
    main: float
    """Megatron's main norm (``get_grad_norm``): every gradient outside a separate group."""
    groups: dict = field(default_factory=dict)
    """Norms of Megatron's separate grad-norm groups (``{'mtp': ...}`` with ``mtp.detach_heads``)."""
    found_inf: bool = False
    """``prepare_grads()``'s answer (only an fp16 loss scaler ever sets it)."""

    @property
    def total(self) -> float:
        """The norm of all gradients: main and groups together."""
        return math.sqrt(self.main ** 2 + sum(g ** 2 for g in self.groups.values()))


def compute_grad_norms(optimizer) -> GradNorms:
    """Prepare the gradients and reduce their norms once (collective over the grad-stats group)."""
    found_inf = bool(optimizer.prepare_grads())
    main = float(optimizer.get_grad_norm())
    # Megatron clips a separate group (MTP heads with mtp_detach_heads) by its own norm; the
    # guard must see those gradients too, so the group norms are computed here as well.
    groups = {name: float(norm) for name, norm in optimizer._compute_grad_norms_by_group().items()}
    return GradNorms(main, groups, found_inf)


@contextlib.contextmanager
def _answering(optimizer, norms: GradNorms):
    def groups():
        optimizer.grad_norms_by_group = dict(norms.groups)
        return optimizer.grad_norms_by_group

    # Instance attributes shadow the class's methods for this one step only.
    optimizer.prepare_grads = lambda: norms.found_inf  # gradients already prepared
    optimizer.get_grad_norm = lambda: norms.main
    optimizer._compute_grad_norms_by_group = groups
    try:
        yield
    finally:
        for name in ("prepare_grads", "get_grad_norm", "_compute_grad_norms_by_group"):
            delattr(optimizer, name)


def step_with_norms(optimizer, norms: GradNorms):
    """Megatron's ``optimizer.step()`` reusing ``norms`` (from :func:`compute_grad_norms` on the
    same gradients); returns what ``step()`` returns."""
    with _answering(optimizer, norms):
        return optimizer.step()
