"""``acceptance_stats`` on 2 gloo ranks against the single-process call in the same script.

    torchrun --nproc_per_node 2 tests/helpers/metrics_tp_case.py --out FILE

Cases: ``tp2`` (the vocabulary sharded over the 2 ranks, ``tp_group``), ``dp2`` (the
positions split over the 2 ranks, ``dp_group``: sums and counts reduced before the means).
Every rank builds the same full inputs from a fixed seed (with an argmax tie across the
two vocabulary shards and cut chains); rank 0 writes ``{case: {errors, tolerance, ok}}``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from bebop_megatron.metrics import acceptance_stats

K, N, V = 3, 37, 1270  # V_local = 635 on 2 ranks; N odd so the DP split is uneven
TEMPS = (0.8, 1.2)
TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12}


def make_inputs(dtype):
    g = torch.Generator().manual_seed(4321)
    target = 2.0 * torch.randn(K, N, V, generator=g, dtype=torch.float64)
    draft = 0.8 * target + torch.randn(K, N, V, generator=g, dtype=torch.float64)
    draft[0, 5, 3] = draft[0, 5, 700] = 40.0  # argmax tie across the two shards: lowest index wins
    target[0, 5, 700] = 30.0
    valid = torch.rand(K, N, generator=g) > 0.2
    valid[:, 0] = False
    valid[:, 1] = torch.tensor([True, False, True])
    valid[:, 5] = True
    labels = torch.randint(0, V, (K, N), generator=g)
    labels[:, 7] = draft[:, 7].argmax(-1)
    return draft.to(dtype), target.to(dtype), valid, labels


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.double().abs().max().item()
    return (got.double() - want.double()).abs().max().item() / max(scale, 1e-30)


def compare(dtype, group, layout) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    draft, target, valid, labels = make_inputs(dtype)
    common = dict(labels=None, target_temperature=TEMPS[0], draft_temperature=TEMPS[1], chunk_tokens=11)
    want = acceptance_stats(draft, target, valid, **{**common, "labels": labels})
    if layout == "tp2":
        cols = slice(rank * (V // world), (rank + 1) * (V // world))
        got = acceptance_stats(draft[..., cols].contiguous(), target[..., cols].contiguous(), valid, tp_group=group,
                               **{**common, "labels": labels})
    else:
        rows = slice(0, 20) if rank == 0 else slice(20, N)
        got = acceptance_stats(draft[:, rows], target[:, rows], valid[:, rows], dp_group=group,
                               **{**common, "labels": labels[:, rows]})
    errors = {name: rel_err(got[name], value) for name, value in want.items()}
    gathered = [torch.empty_like(got["accept_len_rs"]) for _ in range(world)]
    dist.all_gather(gathered, got["accept_len_rs"].contiguous(), group=group)
    errors["same_on_all_ranks"] = rel_err(torch.stack(gathered), got["accept_len_rs"].expand(world, K))
    tol = TOLERANCE[dtype]
    return {"errors": errors, "tolerance": tol, "ok": set(want) == set(got) and all(e <= tol for e in errors.values())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    results = {}
    for dtype, dname in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        for layout in ("tp2", "dp2"):
            results[f"{layout}/{dname}"] = compare(dtype, group, layout)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
