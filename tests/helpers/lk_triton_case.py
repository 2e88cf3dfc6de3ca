"""lk / e2e_lk on the Triton kernel (kind ``tv_kl``, Triton's interpreter on CPU) against the
torch kernel and the float64 references.

    TRITON_INTERPRET=1 python tests/helpers/lk_triton_case.py --out FILE     # CPU, interpreter
    python tests/helpers/lk_triton_case.py --out FILE --device cuda          # GPU, compiled

Tiny sizes, with several tiles and vocabulary splits per row, tiles that do not divide V,
temperatures != 1 and Megatron's padded columns (logit -inf in both distributions):

- ``kernel/...``: ``kernel_triton.forward_rows(kind="tv_kl")`` against kernel_torch's: the
  per-row (d_TV, KL(p||q)), the saved rows, stats and argmax, both forward directions
  (``grad_RV`` TV's, ``grad_kl_RV`` KL's) and ``grad_rows`` with a ``[2, R]`` scale (from
  either implementation's saved rows); and against ``reference`` in float64: d_TV and KL per
  row, and the directions and ``grad_rows`` as autograd gradients of TV, KL and
  ``w_tv TV + w_kl KL`` w.r.t. the draft logits; the padded columns' gradients exactly 0.
  Special rows: draft == target (d_TV = KL = 0 exactly, S = 1) and disjoint supports
  (d_TV = 1, KL = inf, the TV direction exactly 0). The inputs have no near-tie of q and p
  (counted: ``near_ties`` must be 0), so the TV directions compare on every column.
- ``objective/...``: ``lk_loss`` / ``e2e_lk_loss`` with ``impl="triton"`` against
  ``impl="torch"`` and ``reference.objective`` (float64, cut chains; ``grad_in_forward`` both
  ways, i.e. the forward's two directions and ``grad_rows``): loss and draft-logit gradient.
- ``mtp_loss/...`` (CPU only): ``training.loss.mtp_loss`` (``lk``, ``e2e_lk``, and ``ce``, whose
  statistics come from the kernel without gradients) with ``LossConfig(impl="triton")``
  against ``impl="torch"`` (float32 hidden states, a stand-in output layer with padded rows):
  loss sum, stats and the gradient w.r.t. the hidden states.

With ``--device cuda`` the kernel and objective cases run compiled on the GPU (the torch
kernel on the same CUDA tensors; the references on CPU); the KL direction of draft ==
target is then checked within rounding rather than exactly 0, as in triton_kernel_case.py.

Errors are ``max |got - want| / max |want|`` over finite entries (inf and nan must sit at the
same places with the same values). Writes ``{case: {errors, tolerance, ok}}`` as JSON to FILE.
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
import warnings
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.triton_interpreter import patch_once_per_launch  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
REF_TOL = {torch.float32: 2e-5, torch.float64: 1e-10}  # against the float64 references (other formulas)
NEAR_TIE = 1e-5


def err(got, want, floor: float = 1e-30) -> float:
    """``floor``: the least scale errors are relative to (1: absolute, for results 0 up to rounding)."""
    got, want = torch.as_tensor(got).detach().double().cpu(), torch.as_tensor(want).detach().double().cpu()
    if got.shape != want.shape:
        return math.inf
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite].nan_to_num(0.0),
                                                                        want[~finite].nan_to_num(0.0)):
        return math.inf
    if not finite.any():
        return 0.0
    return (got[finite] - want[finite]).abs().max().item() / max(want[finite].abs().max().item(), floor)


def exactly_zero(x) -> float:
    return 0.0 if not bool(torch.as_tensor(x).abs().max()) else math.inf


def logits(seed, shape, dtype, vocab_size=None, device="cpu"):
    """Correlated (draft, target), drawn in float64; columns from ``vocab_size`` on at -inf."""
    g = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(*shape, generator=g, dtype=torch.float64)
    draft = 0.8 * target + torch.randn(*shape, generator=g, dtype=torch.float64)
    if vocab_size is not None:
        draft[..., vocab_size:] = target[..., vocab_size:] = -math.inf
    return draft.to(device=device, dtype=dtype), target.to(device=device, dtype=dtype)


def result(errors: dict, tol: float) -> dict:
    return {"errors": errors, "tolerance": tol, "ok": all(e <= tol for e in errors.values())}


def both(errors: dict, ref_errors: dict, dtype) -> dict:
    """``errors`` (against the torch kernel) within ``TOL``, ``ref_errors`` within ``REF_TOL``."""
    tol, ref_tol = TOL[dtype], REF_TOL[dtype]
    ok = all(e <= tol for e in errors.values()) and all(e <= ref_tol for e in ref_errors.values())
    return {"errors": {**errors, **ref_errors}, "tolerance": tol, "ref_tolerance": ref_tol, "ok": ok}


def kernel_case(kt, kr, ref, draft, target, *, temps, with_stats, vocab, extra=None, floor=1e-30,
                ties=False) -> dict:
    """kernel_triton against kernel_torch and the float64 references (``ref.*``); ``ties``: q == p
    by construction (no near-tie count), ``floor`` as in :func:`err`."""
    err_ = functools.partial(err, floor=floor)
    t_t, t_d = temps
    kw = dict(kind="tv_kl", target_temperature=t_t, draft_temperature=t_d)
    want = kr.forward_rows(draft, target, tp_group=None, with_stats=with_stats, with_grad=True,
                           ws=kr.Workspace(), **kw)
    got = kt.forward_rows(draft, target, tp_group=None, with_stats=with_stats, with_grad=True,
                          ws=kr.Workspace(), **kw)
    g = torch.Generator().manual_seed(3)
    scale = (0.5 + torch.rand((2, *draft.shape[:-1]), generator=g, dtype=torch.float64)).to(draft.device,
                                                                                               want.value_R.dtype)
    rows = kt.grad_rows(draft, target, got.saved_CR, scale, ws=kr.Workspace(), **kw)
    errors = {
        "value": err_(got.value_R, want.value_R), "grad_tv": err_(got.grad_RV, want.grad_RV),
        "grad_kl": err_(got.grad_kl_RV, want.grad_kl_RV),
        "grad_rows": err_(rows, kr.grad_rows(draft, target, want.saved_CR, scale, ws=kr.Workspace(), **kw)),
        "grad_rows.torch_saved": err_(kt.grad_rows(draft, target, want.saved_CR, scale, ws=kr.Workspace(), **kw),
                                     rows),
        "torch_grad_rows.triton_saved": err_(kr.grad_rows(draft, target, got.saved_CR, scale, ws=kr.Workspace(),
                                                         **kw), rows),
    }
    for i, name in enumerate(kr.SAVED_ROWS):
        errors[f"saved.{name}"] = err_(got.saved_CR[i], want.saved_CR[i])
    if with_stats:
        for i, name in enumerate(kr.STAT_KEYS):
            errors[f"stats.{name}"] = err_(got.stats_CR[i], want.stats_CR[i])
        errors["argmax"] = 0.0 if torch.equal(got.argmax_R, want.argmax_R) else math.inf
    else:
        errors["no_stats"] = 0.0 if got.stats_CR is None and got.argmax_R is None else math.inf
    # No near-tie of q and p: the mask 1[q <= p] cannot round differently between the two.
    q = torch.softmax(draft.double() / t_d, -1)
    p = torch.softmax(target.double() / t_t, -1)
    if not ties:
        errors["near_ties"] = float(((q - p).abs() <= NEAR_TIE * torch.maximum(q, p))[(q > 0) | (p > 0)].sum())
    # Against the float64 references, on the unpadded columns; the padded ones get exactly 0.
    z = draft[..., :vocab].double().cpu().requires_grad_()
    tgt = target[..., :vocab].double().cpu()
    tv_R, kl_R = ref.tv_distance(z, tgt, t_t, t_d), ref.kl(tgt, z, t_t, t_d)
    (ref_tv,) = torch.autograd.grad(tv_R.sum(), z, retain_graph=True)
    (ref_kl,) = torch.autograd.grad(torch.where(torch.isfinite(kl_R), kl_R, 0.0).sum(), z, retain_graph=True)
    ref_rows = scale[0].double().cpu()[..., None] * ref_tv + scale[1].double().cpu()[..., None] * ref_kl
    ref_errors = {"ref.value": err_(got.value_R, torch.stack([tv_R, kl_R])),
                  "ref.grad_tv": err_(got.grad_RV[..., :vocab], ref_tv)}
    if torch.isfinite(kl_R).all():  # autograd of an infinite KL is not its direction q - p
        ref_errors["ref.grad_kl"] = err_(got.grad_kl_RV[..., :vocab], ref_kl)
        ref_errors["ref.grad_rows"] = err_(rows[..., :vocab], ref_rows)
    padded = [x[..., vocab:] for x in (got.grad_RV, got.grad_kl_RV, rows)]
    errors["padded_grad_exactly_0"] = max(exactly_zero(x) for x in padded) if padded[0].numel() else 0.0
    if extra is not None:
        errors.update(extra(got))
    return both(errors, ref_errors, want.value_R.dtype)


def kernel_cases(kt, kr, ref, device) -> dict:
    results = {}
    # 5 tiles of 64 (the last partial), 2 splits of 3 tiles, 44 padded columns, temperatures != 1.
    kt.BLOCK_V, kt.SPLITS = 64, 2
    draft, target = logits(1, (8, 301), torch.float32, vocab_size=257, device=device)
    draft[4, 10] = draft[4, 200] = 40.0  # an argmax tie across the splits
    results["kernel/f32/stats"] = kernel_case(kt, kr, ref, draft, target, temps=(0.7, 1.3), with_stats=True,
                                              vocab=257)
    # A [2, 3] leading shape, one split (the CPU default), no stats.
    kt.BLOCK_V, kt.SPLITS = 32, None
    draft, target = logits(2, (2, 3, 150), torch.float32, vocab_size=140, device=device)
    results["kernel/f32/nostats"] = kernel_case(kt, kr, ref, draft, target, temps=(1.3, 0.7), with_stats=False,
                                                vocab=140)
    kt.BLOCK_V, kt.SPLITS = 64, 3
    draft, target = logits(3, (6, 200), torch.float64, vocab_size=190, device=device)
    results["kernel/f64/stats"] = kernel_case(kt, kr, ref, draft, target, temps=(0.7, 1.3), with_stats=True,
                                              vocab=190)
    kt.BLOCK_V, kt.SPLITS = 32, 2
    draft, target = logits(4, (6, 100), torch.bfloat16, device=device)
    results["kernel/bf16/stats"] = kernel_case(kt, kr, ref, draft, target, temps=(1.0, 1.0), with_stats=True,
                                               vocab=100)
    # draft == target: every q_j == p_j (a tie, S = 1); d_TV and KL exactly 0, the KL direction too.
    draft, _ = logits(5, (4, 100), torch.float32, device=device)

    def zero(got):
        grad_kl = got.grad_kl_RV.abs().max().item()
        return {"value_exactly_0": exactly_zero(got.value_R), "S_is_1": (got.saved_CR[4] - 1.0).abs().max().item(),
                "grad_tv_about_0": got.grad_RV.abs().max().item(),
                # q - p is exactly 0 in the interpreter; compiled for CUDA, within rounding
                "grad_kl_exactly_0" if device.type != "cuda" else "grad_kl_about_0":
                    exactly_zero(grad_kl) if device.type != "cuda" else grad_kl}

    results["kernel/ties"] = kernel_case(kt, kr, ref, draft, draft.clone(), temps=(0.9, 0.9), with_stats=True,
                                         vocab=100, extra=zero, floor=1.0, ties=True)
    # Disjoint supports: d_TV = 1, KL = inf, the TV direction exactly 0 (S = 0, q_j > p_j = 0 where q_j > 0).
    draft, target = logits(6, (4, 100), torch.float32, device=device)
    draft[:, 1::2] = -math.inf
    target[:, 0::2] = -math.inf

    def disjoint(got):
        return {"tv_is_1": (got.value_R[0] - 1.0).abs().max().item(),
                "kl_is_inf": 0.0 if bool((got.value_R[1] == math.inf).all()) else math.inf,
                "grad_tv_exactly_0": exactly_zero(got.grad_RV)}

    results["kernel/disjoint"] = kernel_case(kt, kr, ref, draft, target, temps=(0.7, 1.3), with_stats=True,
                                             vocab=100, extra=disjoint, floor=1.0)
    return results


def objective_cases(kt, ref, device) -> dict:
    from bebop_megatron.losses import OBJECTIVES

    kt.BLOCK_V, kt.SPLITS = 32, 2  # several tiles and splits per row of 75 columns
    g = torch.Generator().manual_seed(7)
    K, N, V, vocab = 3, 6, 75, 70
    draft, target = logits(7, (K, N, V), torch.float64, device=device)
    valid = torch.rand(K, N, generator=g) > 0.2
    valid[:, 0] = torch.tensor([True, False, True])  # a cut chain
    valid = valid.to(device)
    results = {}
    for kind in ("lk", "e2e_lk"):
        for grad_in_forward in (False, True):
            out = {}
            for impl in ("torch", "triton"):
                z = draft.clone().requires_grad_()
                loss = OBJECTIVES[kind](z, target, valid, impl=impl, target_temperature=0.7, draft_temperature=1.3,
                                        chunk_tokens=9, vocab_size=vocab, lk_eta=2.0, grad_in_forward=grad_in_forward)
                (grad,) = torch.autograd.grad(2.7 * loss, z)
                out[impl] = (loss.detach(), grad)
            z = draft[..., :vocab].cpu().requires_grad_()
            want = ref.objective(kind, z, target[..., :vocab].cpu(), valid.cpu(), 0.7, 1.3, lk_eta=2.0)
            (want_grad,) = torch.autograd.grad(2.7 * want, z)
            (loss, grad), (torch_loss, torch_grad) = out["triton"], out["torch"]
            errors = {"loss": err(loss, torch_loss), "grad": err(grad, torch_grad),
                      "padded_grad_exactly_0": exactly_zero(grad[..., vocab:])}
            ref_errors = {"ref.loss": err(loss, want), "ref.grad": err(grad[..., :vocab], want_grad)}
            name = f"objective/{kind}/{'grad_in_forward' if grad_in_forward else 'grad_rows'}"
            results[name] = both(errors, ref_errors, torch.float64)
    return results


def mtp_loss_cases(kt) -> dict:
    from megatron.core import parallel_state

    from bebop_megatron.config import LossConfig
    from bebop_megatron.data import Batch
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.loss import mtp_loss

    init_distributed("cpu")
    parallel_state.initialize_model_parallel()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    kt.BLOCK_V, kt.SPLITS = 16, 2
    g = torch.Generator().manual_seed(11)
    B, S, H, V, K, vocab = 2, 9, 8, 37, 3, 33
    hidden = torch.randn((1 + K) * S, B, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H ** 0.5 * 3
    weight[vocab:] = 0.0  # Megatron's padded rows
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    labels = torch.randint(0, vocab, (B, S), generator=g)
    batch = Batch(tokens=labels.clone(), labels=labels, loss_mask=mask, position_ids=torch.arange(S).expand(B, S),
                  sample_ids=torch.arange(B), segment_ids=torch.zeros(B, S, dtype=torch.long))
    model = SimpleNamespace(config=SimpleNamespace(sequence_parallel=False), output_weight=lambda: None,
                            output_layer=SimpleNamespace(weight=weight))
    results = {}
    for kind in ("lk", "e2e_lk", "ce"):  # ce: the Triton kernel's statistics beside the fused cross-entropy
        out = {}
        for impl in ("torch", "triton"):
            h = hidden.clone().requires_grad_()
            cfg = LossConfig(type=kind, impl=impl, target_temperature=0.8, draft_temperature=1.2, chunk_tokens=64,
                             lk_eta=2.0)
            loss_sum, count, stats = mtp_loss(model, h, batch, K, tp_group, cfg, vocab_size=vocab)
            loss_sum.backward()
            out[impl] = (loss_sum.detach(), int(count), stats, h.grad)
        (loss, count, stats, grad), (want_loss, want_count, want_stats, want_grad) = out["triton"], out["torch"]
        errors = {"loss_sum": err(loss, want_loss), "count": 0.0 if count == want_count else math.inf,
                  "stats": err(stats, want_stats), "grad": err(grad, want_grad),
                  "grad_nonzero": 0.0 if bool(grad.abs().max() > 0) else math.inf}
        results[f"mtp_loss/{kind}"] = result(errors, TOL[torch.float32])
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the interpreter's numpy inf - inf

    from bebop_megatron.losses import kernel_torch as kr
    from bebop_megatron.losses import kernel_triton as kt
    from bebop_megatron.losses import reference as ref

    device = torch.device(args.device)
    assert kt._interpreted() == (device.type == "cpu"), "TRITON_INTERPRET=1 on CPU, unset on CUDA"
    if kt._interpreted():
        patch_once_per_launch()  # the interpreter without its repeated language patching (same results)
    results = {**kernel_cases(kt, kr, ref, device), **objective_cases(kt, ref, device)}
    if device.type == "cpu":
        results.update(mtp_loss_cases(kt))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
