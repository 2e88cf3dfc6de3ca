"""``mtp.init`` on a tiny model, checked against what each start promises (1 or 2 ranks).

    torchrun --nproc_per_node 2 tests/helpers/mtp_init_case.py --out FILE key=value ...

For ``identity``: every MTP step k returns ``c * x / rms(x)`` of its input x (the backbone's
final hidden state for step 1, step k-1's output after), c = the RMS of the backbone's
final-norm weight; so step 1's logits are the backbone's own, rescaled. For
``copy_last_layer``: the MTP layer's parameters equal the last decoder layer's. Rank 0 writes
``{init: {errors}}`` as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from bebop_megatron.config import load_config
from bebop_megatron.training import Trainer


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def check(init: str, overrides: list[str]) -> dict:
    cfg = load_config(None, ["device=cpu", "save.dir=null", "train.resume=none", f"mtp.init={init}", *overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    module = trainer.model.module
    K = cfg.mtp.num_steps
    batch = next(trainer.batches())[0]
    errors = {}
    with torch.no_grad():
        hidden = module(batch.tokens, batch.position_ids, None)
        chunks = torch.chunk(hidden, 1 + K, dim=0)
        final_norm = module.decoder.final_layernorm.weight
        if init == "identity":
            c = final_norm.pow(2).mean().sqrt()
            eps = cfg.model.norm_epsilon
            for k in range(1, K + 1):
                # enorm/hnorm weights 1; eh_proj passes hnorm(x); zero output projections; final norm c.
                want = c * rms_norm(rms_norm(chunks[k - 1], eps), eps)
                err = (chunks[k] - want).abs().max() / want.abs().max()
                errors[f"step{k}"] = err.item()
        elif init == "copy_last_layer":
            last = dict(module.decoder.layers[-1].named_parameters())
            layer = module.mtp.layers[0]
            errors["layer"] = max((p - last[n]).abs().max().item() for n, p in layer.mtp_model_layer.named_parameters())
            errors["final_norm"] = (layer.final_layernorm.weight - final_norm).abs().max().item()
    trainer.monitor.close()
    return errors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--inits", default="identity,copy_last_layer")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    results = {}
    for init in args.inits.split(","):
        results[init] = check(init, args.overrides)
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
