"""Vocabulary-parallel objectives on 2 gloo ranks against TP=1 computed in the same script.

    torchrun --nproc_per_node 2 tests/helpers/losses_tp_case.py --out FILE

Every rank builds the same full-vocabulary inputs from a fixed seed and keeps its
contiguous vocabulary slice; each objective runs with ``tp_group`` = the world group; the
draft-logit gradient shards are all-gathered, and rank 0 compares loss, stats and the full
gradient with the unsharded (TP=1) call. Rank 0 writes ``{case: {errors, tolerance, ok}}``
as JSON to FILE. Rows with argmax ties across and within shards check that alpha_TO takes
the lowest global index.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from bebop_megatron.losses import OBJECTIVES, tv_distance
from bebop_megatron.losses.vocab import label_cross_entropy_, masked_padded_vocab

K, N, V = 3, 41, 1270  # V_local = 635 on 2 ranks
TEMPS = (0.7, 1.3)
GRAD_OUT = 2.7
TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12}


def make_inputs(dtype):
    g = torch.Generator().manual_seed(1234)
    target = 2.0 * torch.randn(K, N, V, generator=g, dtype=torch.float64)
    draft = 0.8 * target + torch.randn(K, N, V, generator=g, dtype=torch.float64)
    draft[0, 5, 3] = draft[0, 5, 700] = 40.0  # argmax tie across the two shards
    target[0, 5, 700] = 30.0  # so picking the wrong index moves alpha_TO by ~1
    draft[1, 6, 640] = draft[1, 6, 1000] = 40.0  # tie inside rank 1's shard
    target[1, 6, 1000] = 30.0
    valid = torch.rand(K, N, generator=g) > 0.2
    valid[:, 0] = False
    valid[:, 1] = torch.tensor([True, False, True])
    valid[:, 5] = valid[:, 6] = True
    return draft.to(dtype), target.to(dtype), valid


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.double().abs().max().item()
    return (got.double() - want.double()).abs().max().item() / max(scale, 1e-30)


def gather_vocab(shard: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def compare_objective(kind, dtype, group, vocab_size=None, **kw) -> dict:
    """TP=2 against TP=1; with ``vocab_size`` (Megatron's padding from there on), against TP=1
    on the unpadded logits ``[..., :vocab_size]`` (zero gradient on the padded columns)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    draft, target, valid = make_inputs(dtype)
    num_local = V // world
    cols = slice(rank * num_local, (rank + 1) * num_local)
    fn = OBJECTIVES[kind]
    common = dict(target_temperature=TEMPS[0], draft_temperature=TEMPS[1], return_stats=True, **kw)

    real = slice(0, vocab_size or V)
    full = draft[..., real].clone().requires_grad_()
    want_loss, want_stats = fn(full, target[..., real], valid, **common)
    (want_grad,) = torch.autograd.grad(GRAD_OUT * want_loss, full)
    want_grad = torch.cat([want_grad, want_grad.new_zeros((K, N, V - want_grad.shape[-1]))], dim=-1)

    shard = draft[..., cols].clone().requires_grad_()
    loss, stats = fn(shard, target[..., cols].contiguous(), valid, tp_group=group, vocab_size=vocab_size, **common)
    (grad_shard,) = torch.autograd.grad(GRAD_OUT * loss, shard)
    grad = gather_vocab(grad_shard, group)
    losses = gather_vocab(loss.detach().reshape(1), group)

    errors = {
        "loss": rel_err(loss.detach(), want_loss.detach()),
        "loss_same_on_all_ranks": rel_err(losses, losses[:1].expand_as(losses)),
        "grad": rel_err(grad, want_grad),
    }
    for name, value in want_stats.items():
        errors[f"stats.{name}"] = rel_err(stats[name], value)
    tol = TOLERANCE[dtype]
    return {"errors": errors, "tolerance": tol, "ok": all(e <= tol for e in errors.values())}


def compare_tv_distance(dtype, group) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    draft, target, _ = make_inputs(dtype)
    num_local = V // world
    cols = slice(rank * num_local, (rank + 1) * num_local)
    weights = torch.linspace(0.5, 2.0, N, dtype=dtype)
    full = draft[0].clone().requires_grad_()
    want = tv_distance(full, target[0], target_temperature=TEMPS[0], draft_temperature=TEMPS[1])
    (want_grad,) = torch.autograd.grad((want * weights).sum(), full)
    shard = draft[0, :, cols].clone().requires_grad_()
    got = tv_distance(shard, target[0, :, cols].contiguous(), tp_group=group, target_temperature=TEMPS[0],
                      draft_temperature=TEMPS[1], chunk_tokens=7)
    (grad_shard,) = torch.autograd.grad((got * weights).sum(), shard)
    errors = {
        "value": rel_err(got.detach(), want.detach()),
        "grad": rel_err(gather_vocab(grad_shard, group), want_grad),
    }
    tol = TOLERANCE[dtype]
    return {"errors": errors, "tolerance": tol, "ok": all(e <= tol for e in errors.values())}


def compare_label_ce(dtype, group, vocab_size=None) -> dict:
    """The fused ce's row kernel (``label_cross_entropy_``, gradient in place) on this rank's
    vocabulary shard against float64 ``torch.nn.functional.cross_entropy`` and its autograd
    gradient on the full (unpadded) vocabulary; labels on both shards."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    draft, _, _ = make_inputs(torch.float64)
    logits = draft.reshape(K * N, V)
    real = vocab_size or V
    labels = torch.randint(0, real, (K * N,), generator=torch.Generator().manual_seed(7))
    labels[:2] = torch.tensor([3, real - 1])  # one on each shard's edge
    full = logits[:, :real].clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(full, labels, reduction="none")
    (want_grad,) = torch.autograd.grad(want.sum() * GRAD_OUT, full)
    want_grad = torch.cat([want_grad, want_grad.new_zeros((K * N, V - real))], dim=-1)

    num_local = V // world
    shard = logits[:, rank * num_local:(rank + 1) * num_local].to(dtype).contiguous()
    shard = masked_padded_vocab(shard, vocab_size, group)
    got = label_cross_entropy_(shard, labels, tp_group=group)
    grad = gather_vocab(shard * GRAD_OUT, group)
    errors = {"value": rel_err(got, want.detach()), "grad": rel_err(grad, want_grad),
              "value_same_on_all_ranks": rel_err(gather_vocab(got[None], group), got.repeat(world)[None])}
    tol = TOLERANCE[dtype]
    return {"errors": errors, "tolerance": tol, "ok": all(e <= tol for e in errors.values())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))  # passed explicitly, as Megatron's TP group
    results = {}
    for dtype, dname in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        for kind in OBJECTIVES:
            results[f"{kind}/{dname}"] = compare_objective(kind, dtype, group, chunk_tokens=7)
        results[f"tv_distance/{dname}"] = compare_tv_distance(dtype, group)
    results["e2e_tv/fp32/grad_in_forward"] = compare_objective(
        "e2e_tv", torch.float32, group, chunk_tokens=16, grad_in_forward=True
    )
    results["e2e_tv/fp32/sum"] = compare_objective("e2e_tv", torch.float32, group, reduction="sum")
    # the LK hybrids: TV and KL from one pass, both directions stored; another eta
    results["e2e_lk/fp32/grad_in_forward"] = compare_objective(
        "e2e_lk", torch.float32, group, chunk_tokens=16, grad_in_forward=True
    )
    results["lk/fp64/lk_eta=0.5"] = compare_objective("lk", torch.float64, group, chunk_tokens=7, lk_eta=0.5)
    # Megatron's vocabulary padding: rank 1 holds real and padded columns, or padded ones only.
    for vocab_size in (1000, 600):
        for kind in OBJECTIVES:
            results[f"{kind}/fp64/vocab_size={vocab_size}"] = compare_objective(
                kind, torch.float64, group, vocab_size=vocab_size, chunk_tokens=7)
    # the fused ce's cross-entropy (the data tokens', raw logits), with and without padding
    for dtype, dname in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        for vocab_size in (None, 1000, 600):
            results[f"label_ce/{dname}/vocab_size={vocab_size}"] = compare_label_ce(dtype, group, vocab_size)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
