"""The Triton chunk kernel (``kernel_triton``) against the plain-torch one (``kernel_torch``).

    TRITON_INTERPRET=1 python tests/helpers/triton_kernel_case.py --out FILE            # CPU, interpreter
    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 tests/helpers/triton_kernel_case.py --out FILE --tp  # both
    python tests/helpers/triton_kernel_case.py --out FILE --device cuda --large         # GPU, compiled

Both implementations run on the same inputs; every case compares the per-row value, the
saved rows, the stats and argmax, the gradient of ``forward_rows(with_grad=True)`` and that
of ``grad_rows`` (from the Triton saved rows, and from kernel_torch's: they are
interchangeable). Errors are ``max |got - want| / max |want|`` over finite entries (inf and
nan must sit at the same places with the same values). For TV, the gradient comparisons
leave out the columns where q and p agree within 1e-5 (relative), where rounding may flip
1[q <= p] between two float32 implementations, and S may differ by the q mass there.
Special cases: draft == target (TV and KL exactly 0, S = 1 as ties count as "<=", gradient
~0; the KL gradients exactly 0 in the interpreter), disjoint supports (TV = 1, KL = inf), argmax ties within a tile, across tiles, splits
and (``--tp``) ranks, non-contiguous inputs, bf16 / mixed / float64. ``--large`` adds
production-size cases (512 x 151936 bf16, default tiles and splits) and their timings.

``--tp`` (2 gloo ranks): each rank holds half the vocabulary; the sharded Triton results
are compared with the unsharded kernel_torch ones (the gradient with this rank's slice).
The ranks then share out the single-process cases (``GROUPS[rank::world]``, no collective),
so that one launch runs every interpreted case (each process imports torch and triton once).
Rank 0 (or the single process) writes ``{case: {errors, tolerance, ok}}`` as JSON to FILE
(with ``--tp`` the errors of every rank for the ``tp/...`` cases, named ``rank<r>.<name>``).

Interpreted, Triton's per-device-call re-patching of ``triton.language`` is skipped
(``tests/helpers/triton_interpreter.py``: what the interpreter computes and checks is unchanged).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.triton_interpreter import patch_once_per_launch  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
NEAR_TIE = 1e-5
KINDS = ("tv", "kl", "reverse_kl")
# Rows of the odd-shape, bf16 and --tp cases (odd-shape and --tp: 5 plain ones and the special rows
# 5-7: argmax ties, and under --tp rank 0's shard of q all -inf). Interpreted, time grows with rows
# x tiles (see tests/test_kernel_triton.py).
NUM_ROWS = 8


def scaled_err(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-30) -> float:
    """max |got - want| / max(max |want|, floor) over finite entries; inf if the non-finite entries differ."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return math.inf
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return math.inf
    if not torch.equal(got[~finite].nan_to_num(nan=0.0), want[~finite].nan_to_num(nan=0.0)):
        return math.inf
    if not torch.equal(got[~finite].isnan(), want[~finite].isnan()):
        return math.inf
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().item()
    return (got[finite] - want[finite]).abs().max().item() / max(scale, floor)


def exact_zero(x) -> float:
    """0 when ``x`` (a tensor or a number) is exactly 0 everywhere, inf otherwise."""
    return 0.0 if not bool(torch.as_tensor(x).abs().max()) else math.inf


def logits(seed: int, shape, dtype=torch.float32, device="cpu"):
    """Correlated (draft, target) logits, drawn in float64 and then cast."""
    g = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(*shape, generator=g, dtype=torch.float64)
    draft = 0.8 * target + torch.randn(*shape, generator=g, dtype=torch.float64)
    return draft.to(device=device, dtype=dtype), target.to(device=device, dtype=dtype)


def knobs(kt, block, splits):
    """Tile width and vocabulary splits per row of the Triton kernels (module attributes)."""
    kt.BLOCK_V = block
    kt.SPLITS = splits


def compare(kt, kr, draft, target, *, kind, temps, with_stats, tol, tp_group=None, cols=None, extra=None,
            floor=1e-30):
    """Errors of kernel_triton against kernel_torch; with ``cols``, draft/target are full-vocabulary
    and the Triton side runs on this rank's columns ``cols`` with ``tp_group``. ``floor``: the least
    scale errors are relative to (1: absolute errors, for results that are 0 up to rounding)."""
    err = functools.partial(scaled_err, floor=floor)
    kw = dict(kind=kind, target_temperature=temps[0], draft_temperature=temps[1])
    want = kr.forward_rows(draft, target, tp_group=None, with_stats=with_stats, with_grad=True,
                           ws=kr.Workspace(), **kw)
    d, t = (draft, target) if cols is None else (draft[..., cols], target[..., cols])
    got = kt.forward_rows(d, t, tp_group=tp_group, with_stats=with_stats, with_grad=True, ws=kr.Workspace(), **kw)
    local = (lambda x: x) if cols is None else (lambda x: x[..., cols])
    unmasked, num_near = (lambda x: x), 0
    if kind == "tv":  # leave out the columns where 1[q <= p] may legitimately differ
        near, q64 = near_ties(draft, target, temps)
        ambiguity = torch.where(near, q64, 0.0).sum(-1)  # S may differ by the q mass there
        num_near = int(local(near).sum())
        unmasked = functools.partial(torch.Tensor.masked_fill, mask=local(near), value=0.0)
    errors = {"value": err(got.value_R, want.value_R),
              "grad_forward": err(unmasked(got.grad_RV), unmasked(local(want.grad_RV)))}
    for i, name in enumerate(kr.SAVED_ROWS):
        want_row = want.saved_CR[i]
        if kind == "tv" and name == "aux":
            want_row = want_row.double() + (got.saved_CR[i].double() - want_row).clamp(-ambiguity, ambiguity)
        errors[f"saved.{name}"] = err(got.saved_CR[i], want_row)
    if with_stats:
        for i, name in enumerate(kr.STAT_KEYS):
            errors[f"stats.{name}"] = err(got.stats_CR[i], want.stats_CR[i])
        if getattr(want, "argmax_R", None) is not None:
            errors["argmax"] = 0.0 if torch.equal(got.argmax_R.cpu(), want.argmax_R.cpu()) else math.inf
    else:
        errors["no_stats"] = 0.0 if got.stats_CR is None else math.inf
    g = torch.Generator().manual_seed(7)
    scale = (0.5 + torch.rand(draft.shape[:-1], generator=g, dtype=want.value_R.dtype)).to(draft.device)
    want_rows = unmasked(local(kr.grad_rows(draft, target, want.saved_CR, scale, ws=kr.Workspace(), **kw)))
    errors["grad_rows"] = err(unmasked(kt.grad_rows(d, t, got.saved_CR, scale, ws=kr.Workspace(), **kw)), want_rows)
    errors["grad_rows.torch_saved"] = err(
        unmasked(kt.grad_rows(d, t, want.saved_CR, scale, ws=kr.Workspace(), **kw)), want_rows
    )
    errors["torch_grad_rows.triton_saved"] = err(
        unmasked(local(kr.grad_rows(draft, target, got.saved_CR, scale, ws=kr.Workspace(), **kw))), want_rows
    )
    if extra is not None:
        errors.update(extra(got, want))
    return {"errors": errors, "tolerance": tol, "ok": all(e <= tol for e in errors.values()),
            "near_ties_left_out": num_near}


def near_ties(draft, target, temps):
    """TV: the columns where q and p agree within ``NEAR_TIE`` (relative), where two float32
    implementations may round 1[q <= p] differently (on a GPU, with ~1e8 elements, some do),
    and q in float64."""
    q = torch.softmax(draft.double() / temps[1], dim=-1)
    p = torch.softmax(target.double() / temps[0], dim=-1)
    return (q - p).abs() <= NEAR_TIE * torch.maximum(q, p), q


def argmax_ties(draft, target):
    """Rows 5-7 get tied draft maxima (across splits, within a tile, across tiles of one split)
    with a distinctive target value at the later index, so a wrong pick moves alpha_TO."""
    for row, (a, b) in zip((5, 6, 7), ((3, 700), (10, 20), (100, 300))):
        draft[row, a] = draft[row, b] = 40.0
        target[row, b] = 30.0


def odd_shapes_cases(kt, kr, device) -> dict:
    """Odd shapes, 5 tiles of 256 (the last partial), 3 splits (2, 2 and 1 tiles), temperatures != 1,
    argmax ties (rows 5-7; ``NUM_ROWS``)."""
    results = {}
    knobs(kt, 256, 3)
    draft, target = logits(1, (NUM_ROWS, 1271), device=device)
    argmax_ties(draft, target)
    for kind in KINDS:
        results[f"f32/{kind}/stats"] = compare(kt, kr, draft, target, kind=kind, temps=(0.7, 1.3),
                                               with_stats=True, tol=TOL[torch.float32])
    return results


def leading_shape_cases(kt, kr, device) -> dict:
    """Leading shape [2, 3], no stats, default splits (one on CPU: 7 tiles of 128 in one program, the
    last partial), a row-strided and a column-strided input."""
    results = {}
    knobs(kt, 128, None)
    draft, target = logits(2, (2, 3, 777), device=device)
    for kind in KINDS:
        results[f"f32/{kind}/nostats"] = compare(kt, kr, draft, target, kind=kind, temps=(1.3, 0.7),
                                                 with_stats=False, tol=TOL[torch.float32])
    big_d, big_t = logits(3, (10, 1420), device=device)
    results["f32/tv/strided"] = compare(kt, kr, big_d[:, 7:707], big_t[:, 1:1401:2], kind="tv", temps=(0.7, 1.3),
                                        with_stats=True, tol=TOL[torch.float32])
    return results


def bf16_cases(kt, kr, device) -> dict:
    """bf16 inputs (computed in float32), and bf16 draft with a float32 target."""
    results = {}
    knobs(kt, 256, 2)
    draft, target = logits(4, (NUM_ROWS, 1000), torch.bfloat16, device=device)
    results["bf16/tv/stats"] = compare(kt, kr, draft, target, kind="tv", temps=(1.0, 1.0), with_stats=True,
                                       tol=TOL[torch.float32])
    results["bf16/reverse_kl/nostats"] = compare(kt, kr, draft, target, kind="reverse_kl", temps=(0.7, 1.3),
                                                 with_stats=False, tol=TOL[torch.float32])
    results["mixed/kl/stats"] = compare(kt, kr, draft, target.float(), kind="kl", temps=(0.7, 1.3),
                                        with_stats=True, tol=TOL[torch.float32])
    return results


def f64_cases(kt, kr, device) -> dict:
    """float64 inputs, computed in float64."""
    results = {}
    knobs(kt, 128, 2)
    draft, target = logits(5, (9, 500), torch.float64, device=device)
    for kind in KINDS:
        results[f"f64/{kind}/stats"] = compare(kt, kr, draft, target, kind=kind, temps=(0.7, 1.3),
                                               with_stats=True, tol=TOL[torch.float64])
    return results


def ties_cases(kt, kr, device) -> dict:
    """draft == target (same temperature): every q_j == p_j, a tie; the divergences are exactly 0."""
    results = {}
    knobs(kt, 256, 2)
    draft, _ = logits(6, (6, 1271), device=device)

    def zero_divergence(kind):
        def check(got, _want):
            grad = got.grad_RV.abs().max().item()  # TV: q_j (S - 1) with S = sum q = 1 up to rounding
            out = {"value_exactly_0": exact_zero(got.value_R)}
            out["grad_about_0"] = grad
            if kind == "tv":  # ties count as "<=": S = sum q 1[q <= p] = 1 (0 if they did not)
                out["S_is_1"] = (got.saved_CR[4] - 1.0).abs().max().item()
            elif device.type != "cuda":
                # q - p (kl) and log q - log p (reverse_kl) are exactly 0 in the interpreter; compiled
                # for CUDA they are within rounding (measured on an H200: see benchmarks/README.md).
                out["grad_exactly_0"] = exact_zero(grad)
            return out
        return check

    for kind in KINDS:
        results[f"ties/{kind}"] = compare(kt, kr, draft, draft.clone(), kind=kind, temps=(0.9, 0.9), with_stats=True,
                                          tol=TOL[torch.float32], extra=zero_divergence(kind), floor=1.0)
    return results


def disjoint_cases(kt, kr, device) -> dict:
    """Disjoint supports (-inf logits): q lives on the even columns, p on the odd ones; TV = 1,
    KL infinite, the TV gradient exactly 0 (S = 0, and q_j > p_j = 0 wherever q_j > 0)."""
    results = {}
    knobs(kt, 256, 2)
    draft, target = logits(7, (6, 600), device=device)
    draft[:, 1::2] = -math.inf
    target[:, 0::2] = -math.inf

    def tv_one(kind):
        def check(got, _want):
            out = {"alpha_rs_about_0": got.stats_CR[0].abs().max().item()}  # alpha_RS = 1 - d_TV
            if kind == "tv":
                out["grad_exactly_0"] = exact_zero(got.grad_RV)
            return out
        return check

    for kind in KINDS:
        results[f"disjoint/{kind}"] = compare(kt, kr, draft, target, kind=kind, temps=(0.7, 1.3), with_stats=True,
                                              tol=TOL[torch.float32], extra=tv_one(kind), floor=1.0)
    return results


# The single-process groups, each setting its own knobs; dealt out over the ranks of ``--tp`` as
# ``GROUPS[rank::world]`` (this order, of measured interpreter cost, gives two ranks equal shares).
GROUPS = (odd_shapes_cases, leading_shape_cases, f64_cases, bf16_cases, ties_cases, disjoint_cases)


def single_process_cases(kt, kr, device, large: bool, rank: int = 0, world: int = 1) -> dict:
    """The single-process cases (``rank``/``world``: this rank's share of them), and with ``large``
    the production-size ones."""
    results = {}
    for group in GROUPS[rank::world]:
        results.update(group(kt, kr, device))
    if large:  # production size, the module's default tiles and splits
        kt.BLOCK_V, kt.SPLITS = DEFAULTS
        draft, target = logits(8, (512, 151936), torch.bfloat16, device=device)
        for kind, with_stats in (("tv", False), ("tv", True), ("kl", True), ("reverse_kl", True)):
            name = f"large/{kind}/{'stats' if with_stats else 'nostats'}"
            results[name] = compare(kt, kr, draft, target, kind=kind, temps=(1.0, 1.0), with_stats=with_stats,
                                    tol=TOL[torch.float32])
            results[name]["timing_ms"] = timings(kt, kr, draft, target, kind, with_stats)
    return results


def timings(kt, kr, draft, target, kind, with_stats) -> dict:
    """Forward (with grad) and grad_rows wall times of both implementations (informative only)."""
    out = {}
    kw = dict(kind=kind, target_temperature=1.0, draft_temperature=1.0)
    for name, mod in (("triton", kt), ("torch", kr)):
        ws = kr.Workspace()
        res = mod.forward_rows(draft, target, tp_group=None, with_stats=with_stats, with_grad=True, ws=ws, **kw)
        scale = torch.ones_like(res.value_R)
        for phase, fn in (
            ("forward", lambda: mod.forward_rows(draft, target, tp_group=None, with_stats=with_stats,
                                                 with_grad=False, ws=ws, **kw)),
            ("forward_with_grad", lambda: mod.forward_rows(draft, target, tp_group=None, with_stats=with_stats,
                                                           with_grad=True, ws=ws, **kw)),
            ("grad_rows", lambda: mod.grad_rows(draft, target, res.saved_CR, scale, ws=ws, **kw)),
        ):
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            out[f"{name}.{phase}"] = (time.perf_counter() - start) / 5 * 1e3
    return out


def tp_cases(kt, kr, group) -> dict:
    """Sharded (2 ranks) Triton results against the unsharded kernel_torch ones."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    results = {}
    knobs(kt, 128, 2)
    V = 1270
    cols = slice(rank * V // world, (rank + 1) * V // world)
    for dtype in (torch.float32, torch.float64):
        draft, target = logits(11, (NUM_ROWS, V), dtype)
        draft[5, 3] = draft[5, 700] = 40.0  # argmax tie across the two shards
        target[5, 700] = 30.0
        draft[6, 640] = draft[6, 1000] = 40.0  # tie inside rank 1's shard
        target[6, 1000] = 30.0
        draft[7, :635] = -math.inf  # rank 0's shard of q is all -inf
        name = "f32" if dtype == torch.float32 else "f64"
        for kind in KINDS if dtype == torch.float32 else ("tv",):
            results[f"tp/{name}/{kind}/stats"] = compare(kt, kr, draft, target, kind=kind, temps=(0.7, 1.3),
                                                         with_stats=True, tol=TOL[dtype], tp_group=group, cols=cols)
    draft, target = logits(12, (NUM_ROWS, V))
    results["tp/f32/tv/nostats"] = compare(kt, kr, draft, target, kind="tv", temps=(1.3, 0.7), with_stats=False,
                                           tol=TOL[torch.float32], tp_group=group, cols=cols)
    return results


DEFAULTS = (None, None)


def main() -> None:
    global DEFAULTS
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--large", action="store_true", help="also the production-size cases (CUDA)")
    parser.add_argument("--tp", action="store_true",
                        help="2 ranks: the vocabulary-parallel cases, and the single-process ones shared out")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the interpreter's numpy inf - inf

    from bebop_megatron.losses import kernel_torch as kr
    from bebop_megatron.losses import kernel_triton as kt

    if kt._interpreted():
        patch_once_per_launch()
    DEFAULTS = (kt.BLOCK_V, kt.SPLITS)
    if args.tp:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        group = dist.new_group(list(range(world)))
        mine = tp_cases(kt, kr, group)
        # This rank's share of the single-process cases (tp_group=None: no collective), while the
        # other ranks run theirs: one launch instead of a second interpreter process.
        single = single_process_cases(kt, kr, torch.device(args.device), args.large, rank, world)
        every = [None] * world
        dist.all_gather_object(every, (mine, single))
        results = {  # each rank's errors (its gradient shard, the same per-row results), prefixed by rank
            case: {"errors": {f"rank{r}.{n}": e for r, (res, _) in enumerate(every)
                              for n, e in res[case]["errors"].items()},
                   "tolerance": mine[case]["tolerance"], "ok": all(res[case]["ok"] for res, _ in every)}
            for case in mine
        }
        for _, theirs in every:
            assert not set(theirs) & set(results), "a single-process case ran twice"
            results.update(theirs)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        dist.barrier()
        dist.destroy_process_group()
        return
    results = single_process_cases(kt, kr, torch.device(args.device), args.large)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
