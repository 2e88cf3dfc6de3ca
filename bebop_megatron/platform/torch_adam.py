"""Distributed-optimizer checkpoints with torch's own Adam (no apex, no Transformer Engine).

Megatron-Core 0.19 selects torch.optim.Adam when neither apex nor Transformer Engine imports
(CPU, or a GPU without TE). Its fully reshardable distributed-optimizer checkpoints then fail
to load for two reasons, both fixed here and only in that case:

- ``DistributedOptimizer.state_dict()`` reads Adam's per-parameter ``step``, which a fresh
  optimizer lacks: :func:`give_fresh_adam_state` creates zero state (loading replaces it).
- ``_set_main_param_and_optimizer_states`` copies every tensor of Adam's state from the
  checkpoint, ``step`` included, which the checkpoint does not hold (``step`` is restored from
  the param groups): :func:`skip_step_when_loading` hides ``step`` during that copy. The
  restored ``step`` is one tensor shared by all parameters, which torch's Adam increments in
  place once per parameter (a resumed run's bias correction then drifts); each parameter gets
  its own copy back.
"""

from __future__ import annotations

import torch


def _uses_torch_adam() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def give_fresh_adam_state(optimizer) -> None:
    """Zero Adam state (step included) for parameters that have none yet."""
    if not _uses_torch_adam():
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                          "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


def skip_step_when_loading() -> None:
    """Redirection (idempotent): reason in the module docstring, second item."""
    if not _uses_torch_adam():
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "skips_step", False):
        return

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step.clone()  # not shared: Adam increments it in place

    set_states.skips_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
