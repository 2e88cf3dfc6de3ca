"""Single-rank probes of one training step, printed as JSON on the last stdout line.

    python tests/helpers/probe_step.py repeated key=value ...
    python tests/helpers/probe_step.py memory key=value ...
    python tests/helpers/probe_step.py memory key=value ... -- repeated key=value ... -- ...

Several probes (separated by ``--``) run one after the other in this process, each with its own
Trainer, and print one JSON line each, in order; ``memory`` only as the first (it measures the
process's peak RSS).

``repeated``: with one MTP layer reused for K steps, the MTP block holds one layer, and the
gradient of its weights from the full loss equals the sum of the gradients of the K
per-step terms, each non-zero (every step feeds the shared weights).

``memory``: bytes of tensors saved for backward during the forward of one step (the
autograd graph's activations), and the process's peak RSS growth over one step.
"""

from __future__ import annotations

import json
import resource
import sys

import torch

from bebop_megatron.config import load_config
from bebop_megatron.training import Trainer
from bebop_megatron.chain.masks import chain_valid
from megatron.core import parallel_state


def probe_repeated(trainer: Trainer) -> dict:
    module = trainer.model.module
    K = trainer.cfg.mtp.num_steps
    batch = next(trainer.batches())[0]
    hidden = module(batch.tokens, batch.position_ids, None)
    chunks = torch.chunk(hidden, 1 + K, dim=0)
    labels_SB = batch.labels.t().contiguous()
    valid_KSB = chain_valid(batch.loss_mask, K).transpose(1, 2)
    S = labels_SB.shape[0]
    shared = [p for n, p in module.named_parameters() if n.startswith("mtp.layers.0.")]
    per_step, total = [], 0.0
    for k in range(1, K + 1):
        logits, _ = module.output_layer(chunks[k], weight=module.output_weight())
        target = torch.zeros_like(labels_SB)
        target[: S - k] = labels_SB[k:]
        # Plain torch CE (TP=1): Megatron's vocab-parallel CE backward is not re-entrant.
        ce = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), target.flatten(), reduction="none"
        ).view_as(target)
        term = (ce * valid_KSB[k - 1]).sum()
        per_step.append(torch.autograd.grad(term, shared, retain_graph=True))
        total = total + term
    full = torch.autograd.grad(total, shared)
    summed = [sum(g[i] for g in per_step) for i in range(len(shared))]
    return {
        "num_mtp_layers": len(module.mtp.layers),
        "mtp_param_numel": sum(p.numel() for n, p in module.named_parameters() if n.startswith("mtp.")),
        "max_rel_diff_full_vs_sum": max(
            ((f - s).abs().max() / f.abs().max().clamp(min=1e-30)).item() for f, s in zip(full, summed)
        ),
        "per_step_grad_norms": [float(torch.sqrt(sum((g ** 2).sum() for g in grads))) for grads in per_step],
    }


def probe_memory(trainer: Trainer) -> dict:
    batches = next(trainer.batches())
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.forward_backward(batches)
    trainer.optimizer_step()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"saved_activation_bytes": sum(saved.values()), "peak_rss_kb": rss_after, "rss_growth_kb": rss_after - rss_before}


def probe(what: str, overrides: list[str]) -> dict:
    cfg = load_config(overrides=["device=cpu", "save.dir=null", "train.resume=none", *overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    return probe_repeated(trainer) if what == "repeated" else probe_memory(trainer)


def main() -> None:
    probes, args = [], sys.argv[1:]
    while args:
        end = args.index("--") if "--" in args else len(args)
        probes.append((args[0], args[1:end]))
        args = args[end + 1:]
    assert all(what != "memory" for what, _ in probes[1:]), "memory: the process's first probe only"
    for what, overrides in probes:
        print(json.dumps(probe(what, overrides)), flush=True)


if __name__ == "__main__":
    main()
