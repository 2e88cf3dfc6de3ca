"""The Triton chunk kernel (``kernel_triton``, ``impl="triton"``) against ``kernel_torch``.

Without a GPU:

- Triton's interpreter (``TRITON_INTERPRET=1``, which must be set before triton is
  imported, hence a subprocess) runs ``tests/helpers/triton_kernel_case.py`` on CPU tensors:
  kinds tv / kl / reverse_kl, with and without stats, temperatures != 1, odd shapes with
  tiles that do not divide V and several vocabulary splits per row, a ``[2, 3, V]`` leading
  shape, strided inputs, bf16 / mixed bf16-fp32 / float64, draft == target (ties: exactly 0,
  S = 1), disjoint supports (TV = 1, KL = inf), argmax ties; and a 2-rank gloo run where
  each rank holds half the vocabulary (sharded results == unsharded ones). TV gradients are
  compared outside near-ties of q and p (see the helper's docstring). One launch of 2 ranks
  (``run_script``: ``cli_batch.launch_ranks``, no torchrun launcher) runs all of it: the TP cases, then
  the single-process ones shared out over the ranks.

  Shapes: the interpreter runs every program instance in Python, so its time grows with
  rows x tiles, not with the tile width. The odd-shape and TP cases have 8 rows (5 plain,
  and rows 5-7 with the argmax ties within a tile, across tiles of one split and across
  splits, or under TP across and inside shards and a shard of q all -inf), the bf16 ones 8
  plain rows, the leading-shape case ``[2, 3, 777]`` (6 rows, still a 2-d leading shape); the
  columns, tile widths and splits, and so every boundary (partial last tile, several tiles
  per split, 3 splits, one split of 7 tiles, strided rows and columns), are unchanged. The
  rows dropped (23 -> 8, [3, 5] -> [2, 3], 16 -> 8, TP 12 -> 8) were plain random rows
  through the same code path. Interpreted, Triton's per-device-call re-patching of
  ``triton.language`` is skipped (``tests/helpers/triton_interpreter.py``; results unchanged).
- Every kernel specialisation is compiled for sm_90 (H100/H200) through Triton's whole
  pipeline down to a cubin: types, the float64 path and the launch options are checked by
  the compiler, which the interpreter does not do.

With a GPU (``-m gpu``; skipped without CUDA): the same cases compiled on CUDA, plus
production-size ones (512 rows x 151936 vocabulary, bf16).
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.triton_compile import compile_sm90

KINDS = ("tv", "kl", "reverse_kl")
SINGLE_CASES = (
    {f"f32/{kind}/{stats}" for kind in KINDS for stats in ("stats", "nostats")}
    | {f"f64/{kind}/stats" for kind in KINDS}
    | {f"{special}/{kind}" for special in ("ties", "disjoint") for kind in KINDS}
    | {"f32/tv/strided", "bf16/tv/stats", "bf16/reverse_kl/nostats", "mixed/kl/stats"}
)
TP_CASES = {f"tp/f32/{kind}/stats" for kind in KINDS} | {"tp/f64/tv/stats", "tp/f32/tv/nostats"}
LARGE_CASES = {"large/tv/nostats", "large/tv/stats", "large/kl/stats", "large/reverse_kl/stats"}


def _run(tmp_path_factory, name: str, args: list[str], nproc: int, interpret: bool) -> dict:
    out = tmp_path_factory.mktemp(name) / "result.json"
    env = {"TRITON_INTERPRET": "1"} if interpret else {}
    with mock.patch.dict(os.environ, env):
        if not interpret:
            os.environ.pop("TRITON_INTERPRET", None)
        run_script("triton_kernel_case.py", ["--out", str(out), *args], nproc=nproc, timeout=600)
    return json.loads(out.read_text())


def _check(results: dict, case: str) -> None:
    result = results[case]
    bad = {name: err for name, err in result["errors"].items() if not err <= result["tolerance"]}
    assert result["ok"] and not bad, f"{case}: errors above {result['tolerance']}: {bad}"


@pytest.fixture(scope="module")
def interpreted_all(tmp_path_factory):
    """Every interpreted case from one 2-rank launch: the TP cases, and the single-process ones
    shared out over the two ranks."""
    return _run(tmp_path_factory, "triton_interpreted", ["--tp"], nproc=2, interpret=True)


@pytest.fixture(scope="module")
def interpreted(interpreted_all):
    return {case: result for case, result in interpreted_all.items() if not case.startswith("tp/")}


@pytest.fixture(scope="module")
def interpreted_tp(interpreted_all):
    return {case: result for case, result in interpreted_all.items() if case.startswith("tp/")}


def test_interpreted_cases_ran(interpreted, interpreted_tp):
    assert set(interpreted) == SINGLE_CASES
    assert set(interpreted_tp) == TP_CASES


@pytest.mark.parametrize("case", sorted(SINGLE_CASES))
def test_interpreted_equals_torch(interpreted, case):
    _check(interpreted, case)


@pytest.mark.parametrize("case", sorted(TP_CASES))
def test_interpreted_tp2_equals_unsharded(interpreted_tp, case):
    _check(interpreted_tp, case)


def _kernel_module():
    from bebop_megatron.losses import kernel_triton

    if kernel_triton._interpreted():
        pytest.skip("TRITON_INTERPRET is set in this process: the kernels are interpreted, not compiled")
    return kernel_triton


def test_cpu_tensors_need_cuda_or_the_interpreter():
    kt = _kernel_module()
    from bebop_megatron.losses.kernel_torch import Workspace

    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="CUDA"):
        kt.forward_rows(x, x, kind="tv", target_temperature=1.0, draft_temperature=1.0, tp_group=None,
                        with_stats=False, with_grad=False, ws=Workspace())


# Integer arguments equal to 1 are specialised to constants at launch (one row, one tile per split).
_ONES = {"R": 1, "stride_d": 1, "stride_t": 1, "stride_s": 1, "stride_o": 1, "tiles_per_split": 1}


def _specialisations(kt):
    """(kernel, constexprs, input dtype, compute dtype) of every launch forward_rows/grad_rows makes
    (float64, and integer arguments specialised to 1: the heaviest variant of each kernel)."""
    for inp, comp, ones in (("bf16", "fp32", {}), ("fp64", "fp64", {}), ("bf16", "fp32", _ONES)):
        full = inp != "fp64" and not ones
        for with_arg in (False, True) if full else (True,):
            yield kt.softmax_stats_kernel, {"WITH_ARG": with_arg}, inp, comp, ones
        for kind in range(3) if full else (2,):
            for with_stats in (False, True) if full else (True,):
                yield kt.parts_kernel, {"KIND": kind, "WITH_STATS": with_stats}, inp, comp, ones
            yield kt.grad_kernel, {"KIND": kind}, inp, comp, ones


def test_kernels_compile_for_sm90():
    """Full compilation (TTIR -> TTGIR -> LLVM -> PTX -> cubin via ptxas) for sm_90, no GPU needed."""
    kt = _kernel_module()
    for kernel, constexprs, inp, comp, ones in _specialisations(kt):
        compile_sm90(kt, kernel, {**constexprs, **{k: v for k, v in ones.items() if k in kernel.arg_names}}, inp, comp)


@pytest.fixture(scope="module")
def on_cuda(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _run(tmp_path_factory, "triton_cuda", ["--device", "cuda", "--large"], nproc=1, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SINGLE_CASES | LARGE_CASES))
def test_cuda_equals_torch(on_cuda, case):
    assert set(on_cuda) == SINGLE_CASES | LARGE_CASES
    _check(on_cuda, case)
