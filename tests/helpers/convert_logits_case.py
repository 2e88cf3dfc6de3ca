"""Load converted checkpoints at several layouts in turn and compare their logits with transformers'.

    torchrun --nproc_per_node 2 tests/helpers/convert_logits_case.py --spec cases.json --out result.json

or as a call of a 2-rank launch of tests/helpers/cli_batch.py (``main(argv)``), after the calls
that write the checkpoints (made by rank 0 alone).

``cases.json``: a JSON list of ``{"ckpt", "hf_dir", "family", "layouts"}``; each layout is
comma-separated overrides, e.g. ``"parallel.tensor=2,parallel.sequence_parallel=true"``. The
process groups and the model are rebuilt for each (on 2 ranks, ``parallel.tensor=1`` is TP=1
with DP=2). Rank 0 writes ``{"rel_err": [[max|megatron - hf| / max|hf| per layout] per case]}``
over the backbone logits of a fixed random batch (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bebop_megatron.config import load_config  # noqa: E402  (quiets Megatron's notices first)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON list of cases")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from bebop_megatron.platform import init_distributed

    rank, world = init_distributed("cpu")
    with open(args.spec) as f:
        cases = json.load(f)
    result = {"rel_err": [check(c["ckpt"], c["hf_dir"], c["family"], c["layouts"], rank, world) for c in cases]}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()


def check(ckpt: str, hf_dir: str, family: str, layouts: list[str], rank: int, world: int) -> list[float]:
    """Relative max error of the backbone logits per layout (rank 0; empty elsewhere)."""
    from megatron.core import parallel_state, tensor_parallel

    from bebop_megatron.model import build_model
    from bebop_megatron.training.model_weights import load_model_weights
    from bebop_megatron.training.parallel import setup_parallel
    from tests.helpers.convert_models import hf_logits

    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(12).unsqueeze(0).expand(2, 12)
    ref = hf_logits(hf_dir, family, tokens) if rank == 0 else None
    errors = []
    for layout in layouts:
        cfg = load_config(os.path.join(ckpt, "bebop_model.yaml"),
                          ["device=cpu", "save.dir=null", "train.resume=none", "model.transformer_impl=local",
                           *layout.split(",")])
        setup_parallel(cfg, world)
        model = build_model(cfg, "cpu")
        model.eval()
        load_model_weights(ckpt, model, backbone_only=False)
        with torch.no_grad():
            hidden = model(tokens, pos, None)
            h = torch.chunk(hidden, 1 + cfg.mtp.num_steps, dim=0)[0]
            logits, _ = model.output_layer(h, weight=model.output_weight())
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(
                logits, group=parallel_state.get_tensor_model_parallel_group())
        logits = logits.transpose(0, 1)[..., :96].float()
        if rank == 0:
            errors.append((logits - ref).abs().max().item() / ref.abs().max().item())
    return errors


if __name__ == "__main__":
    main()
