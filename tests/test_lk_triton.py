"""The LK hybrids (``lk``, ``e2e_lk``) on the Triton kernel: its kind ``tv_kl`` (d_TV and
KL(p||q) of a row from one pass over the vocabulary tiles) against kernel_torch's and the
float64 references.

- Interpreted (``TRITON_INTERPRET=1``, set before triton is imported, hence a subprocess):
  ``tests/helpers/lk_triton_case.py`` on CPU tensors: the kernel's per-row (d_TV, KL), saved
  rows, stats, both forward directions and ``grad_rows`` with per-row TV and KL weights
  (float32, bf16, float64; temperatures != 1; padded vocabulary columns; several tiles and
  splits; draft == target; disjoint supports); the ``lk`` / ``e2e_lk`` objectives and
  ``training.loss.mtp_loss`` with ``impl="triton"`` against ``impl="torch"`` (also for ``ce``: the
  kernel's statistics without gradients beside the fused cross-entropy).
- Compiled for sm_90 through Triton's whole pipeline down to a cubin (no GPU needed): the
  new specialisations, kernel B with the tv_kl kind and kernel C with its two forms (the
  forward's two outputs, the backward's weighted sum), as ``test_kernel_triton.py`` does for
  the other kinds.

With a GPU (``-m gpu``; skipped without CUDA): the kernel and objective cases compiled on CUDA.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.triton_compile import compile_sm90

KERNEL_CASES = {f"kernel/{name}" for name in ("f32/stats", "f32/nostats", "f64/stats", "bf16/stats", "ties",
                                                "disjoint")}
OBJECTIVE_CASES = {f"objective/{kind}/{grad}" for kind in ("lk", "e2e_lk") for grad in ("grad_rows", "grad_in_forward")}
MTP_LOSS_CASES = {"mtp_loss/lk", "mtp_loss/e2e_lk", "mtp_loss/ce"}
CPU_CASES = KERNEL_CASES | OBJECTIVE_CASES | MTP_LOSS_CASES


def _run(tmp_path_factory, name: str, args: list[str], interpret: bool) -> dict:
    out = tmp_path_factory.mktemp(name) / "result.json"
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"} if interpret else {}):
        if not interpret:
            os.environ.pop("TRITON_INTERPRET", None)
        run_script("lk_triton_case.py", ["--out", str(out), *args], nproc=1, timeout=600)
    return json.loads(out.read_text())


def _check(results: dict, case: str) -> None:
    result = results[case]
    bad = {name: err for name, err in result["errors"].items()
           if not err <= result["ref_tolerance" if name.startswith("ref.") else "tolerance"]}
    assert result["ok"] and not bad, f"{case}: errors above {result['tolerance']} ({result.get('ref_tolerance')} " \
                                     f"for ref.*): {bad}"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    return _run(tmp_path_factory, "lk_triton_interpreted", [], interpret=True)


def test_interpreted_cases_ran(interpreted):
    assert set(interpreted) == CPU_CASES


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_equals_torch_and_reference(interpreted, case):
    _check(interpreted, case)


def _compiled_kernels():
    pytest.importorskip("triton")
    from bebop_megatron.losses import kernel_triton

    if kernel_triton._interpreted():
        pytest.skip("TRITON_INTERPRET is set in this process: the kernels are interpreted, not compiled")
    return kernel_triton


def test_tv_kl_kernels_compile_for_sm90():
    """Full compilation (TTIR -> TTGIR -> LLVM -> PTX -> cubin via ptxas) for sm_90, no GPU needed."""
    kt = _compiled_kernels()
    from bebop_megatron.losses.kernel_triton_jit import TV_KL, TV_KL_SUM

    launches = [(kt.parts_kernel, {"KIND": TV_KL, "WITH_STATS": stats}) for stats in (False, True)]
    launches += [(kt.grad_kernel, {"KIND": kind}) for kind in (TV_KL, TV_KL_SUM)]
    for inp, comp in (("bf16", "fp32"), ("fp32", "fp32"), ("fp64", "fp64")):
        for kernel, constexprs in launches:
            compile_sm90(kt, kernel, constexprs, inp, comp)


@pytest.fixture(scope="module")
def on_cuda(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _run(tmp_path_factory, "lk_triton_cuda", ["--device", "cuda"], interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(KERNEL_CASES | OBJECTIVE_CASES))
def test_cuda_equals_torch_and_reference(on_cuda, case):
    assert set(on_cuda) == KERNEL_CASES | OBJECTIVE_CASES
    _check(on_cuda, case)
