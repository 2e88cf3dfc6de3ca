"""The imported Megatron backbone against transformers' logits on real text, at any TP.

    torchrun --nproc_per_node 2 benchmarks/real_model/check_import.py --checkpoint CACHE/megatron \
        --reference CACHE/check_reference.pt --out CACHE/check_tp2.json

``--reference``: ``{"tokens": [S], "logits": [S, V]}`` from transformers (float32). Rank 0
writes the max |logit difference|, the top-1 agreement and both perplexities as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bebop_megatron.config import load_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.model_weights import load_model_weights
    from bebop_megatron.training.parallel import setup_parallel

    rank, world = init_distributed("cpu")
    cfg = load_config(os.path.join(args.checkpoint, "bebop_model.yaml"),
                      ["device=cpu", "save.dir=null", "train.resume=none", f"parallel.tensor={world}"])
    setup_parallel(cfg, world)
    model = build_model(cfg, "cpu")
    model.eval()
    load_model_weights(args.checkpoint, model, backbone_only=True)
    ref = torch.load(args.reference)
    tokens = ref["tokens"][None]
    S = tokens.shape[1]
    with torch.no_grad():
        hidden = model(tokens, torch.arange(S)[None], None)
        h = torch.chunk(hidden, 1 + cfg.mtp.num_steps, dim=0)[0]
        logits, _ = model.output_layer(h, weight=model.output_weight())
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(
            logits, group=parallel_state.get_tensor_model_parallel_group())
    got = logits[:, 0, : cfg.model.vocab_size].float()
    want = ref["logits"][:, : cfg.model.vocab_size].float()
    if rank == 0:
        targets = tokens[0, 1:]

        def ppl(z):
            return math.exp(torch.nn.functional.cross_entropy(z[:-1], targets).item())

        result = {
            "tensor_parallel": world, "num_tokens": S,
            "max_abs_logit_diff": (got - want).abs().max().item(),
            "max_abs_logit": want.abs().max().item(),
            "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "ppl_megatron": ppl(got), "ppl_transformers": ppl(want),
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
