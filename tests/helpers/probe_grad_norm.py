"""One optimizer step two ways on the same gradients, and a non-finite gradient; JSON on stdout.

    python tests/helpers/probe_grad_norm.py key=value ... [-- key=value ...]

One JSON line per case (cases separated by ``--``, each its own Trainer, one after the other).

``before``: the trainer's step as it was before the norm was reused (prepare_grads +
get_grad_norm for the guard, then Megatron's ``optimizer.step()``, which reduces the norm
again). ``after``: ``Trainer.optimizer_step``. Both start from the same parameters, fresh
Adam state and the same gradients; ``reference`` is the float64 formula (clip by the global
norm, first Adam step, no weight decay). Also counts Megatron's ``get_grad_norm_fp32`` calls
per step, and checks that a NaN or Inf in one MTP gradient skips the update.
"""

from __future__ import annotations

import json
import sys

import torch
from megatron.core.optimizer import optimizer as megatron_optimizer

from bebop_megatron.config import load_config
from bebop_megatron.training import Trainer

calls = [0]
_norm_fp32 = megatron_optimizer.get_grad_norm_fp32


def counting_norm(*args, **kwargs):
    calls[0] += 1
    return _norm_fp32(*args, **kwargs)


megatron_optimizer.get_grad_norm_fp32 = counting_norm


def step_before(trainer: Trainer) -> None:
    """The pre-change Trainer.optimizer_step (single rank, finite gradients)."""
    trainer.optimizer.prepare_grads()
    trainer.optimizer.get_grad_norm()
    trainer.optimizer.step()
    trainer.scheduler.step(increment=1)


def main() -> None:
    cases = [[]]
    for arg in sys.argv[1:]:
        cases.append([]) if arg == "--" else cases[-1].append(arg)
    for overrides in cases:
        print(json.dumps(probe(overrides)), flush=True)


def probe(overrides: list[str]) -> dict:
    cfg = load_config(overrides=["device=cpu", "save.dir=null", "train.resume=none", *overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    params = [p for p in trainer.model.module.parameters() if p.requires_grad]
    trainer.forward_backward(next(trainer.batches()))
    grads0 = [p.main_grad.detach().clone() for p in params]
    start = [p.detach().clone() for p in params]
    lr = trainer.optimizer.param_groups[0]["lr"]
    inner = [opt.optimizer for opt in trainer.optimizer.chained_optimizers]

    def reset() -> None:  # same weights, same gradients, fresh Adam state
        with torch.no_grad():
            for p, w, g in zip(params, start, grads0):
                p.copy_(w)
                p.main_grad.copy_(g)
        for opt in inner:
            opt.state.clear()

    result = {}
    for name, run in (("before", step_before), ("after", trainer.optimizer_step)):
        reset()
        calls[0] = 0
        norm = run(trainer) if name == "before" else run()
        result[name] = {"norm_passes": calls[0], "norm": None if norm is None else float(norm)}
        result[name + "_params"] = [p.detach().clone() for p in params]
        result[name + "_grads"] = [p.main_grad.detach().clone() for p in params]  # clipped in place

    # float64 reference: g * min(1, clip / (norm + 1e-6)); first Adam step: p - lr * g / (|g| + eps)
    g64 = [g.double() for g in grads0]
    norm64 = float(torch.sqrt(sum((g ** 2).sum() for g in g64)))
    coeff = min(1.0, cfg.train.clip_grad / (norm64 + 1e-6))
    ref = [w.double() - lr * (coeff * g) / ((coeff * g).abs() + cfg.train.adam_eps) for w, g in zip(start, g64)]
    before, after = result.pop("before_params"), result.pop("after_params")
    grads_before, grads_after = result.pop("before_grads"), result.pop("after_grads")
    result["max_diff_clipped_grad_after_vs_before"] = max(
        float((a - b).abs().max()) for a, b in zip(grads_after, grads_before))
    result["max_rel_diff_clipped_grad_vs_reference"] = max(
        float((a.double() - coeff * g).abs().max() / (coeff * g).abs().max()) for a, g in zip(grads_after, g64))
    result["max_diff_after_vs_before"] = max(float((a - b).abs().max()) for a, b in zip(after, before))
    result["max_diff_after_vs_reference"] = max(float((a.double() - r).abs().max()) for a, r in zip(after, ref))
    result["max_update"] = max(float((a - w).abs().max()) for a, w in zip(after, start))
    result["reference_norm"] = norm64
    result["clip_coeff"] = coeff

    for bad in ("nan", "inf"):
        reset()
        with torch.no_grad():
            params[-1].main_grad.view(-1)[0] = float(bad)
        trainer.optimizer.prepare_grads()
        main_norm = float(trainer.optimizer.get_grad_norm())  # what the guard used to look at
        norm = float(trainer.optimizer_step())
        result[bad] = {
            "skipped": trainer.last_step_skipped, "norm": repr(norm), "megatron_main_norm": repr(main_norm),
            "unchanged": all(torch.equal(p, w) for p, w in zip(params, start)),
        }
    return result


if __name__ == "__main__":
    main()
