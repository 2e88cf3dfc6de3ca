"""nla / e2e_nla with ``impl="triton"`` (Triton's interpreter, CPU) against ``impl="torch"``.

    TRITON_INTERPRET=1 python tests/helpers/cold_start_triton_case.py --out FILE

Both objectives need only d_TV per row and its Eq. 11 direction, i.e. the Triton kernel's
``tv`` kind unchanged; this checks the wiring (loss and draft-logit gradient, float64,
temperatures, cut chains, padded vocabulary, tiles not dividing V). Writes
``{kind: {errors, tolerance, ok}}`` as JSON to FILE. The interpreter runs without its repeated
language patching (``tests/helpers/triton_interpreter.py``: same results, less time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bebop_megatron.losses import OBJECTIVES  # noqa: E402
from bebop_megatron.losses import kernel_triton  # noqa: E402
from tests.helpers.triton_interpreter import patch_once_per_launch  # noqa: E402

TOLERANCE = 1e-12


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / max(scale, 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    assert kernel_triton._interpreted(), "set TRITON_INTERPRET=1"
    patch_once_per_launch()  # the interpreter without its repeated language patching (same results)
    kernel_triton.BLOCK_V, kernel_triton.SPLITS = 32, 2  # several tiles and splits per row of 75 columns
    g = torch.Generator().manual_seed(7)
    K, N, V = 3, 6, 75
    target = 2.0 * torch.randn(K, N, V, generator=g, dtype=torch.float64)
    draft = 0.8 * target + torch.randn(K, N, V, generator=g, dtype=torch.float64)
    valid = torch.rand(K, N, generator=g) > 0.2
    valid[:, 0] = torch.tensor([True, False, True])
    results = {}
    for kind in ("nla", "e2e_nla"):
        out = {}
        for impl in ("torch", "triton"):
            z = draft.clone().requires_grad_()
            loss = OBJECTIVES[kind](z, target, valid, impl=impl, target_temperature=0.7, draft_temperature=1.3,
                                    chunk_tokens=5, vocab_size=70)
            (grad,) = torch.autograd.grad(2.7 * loss, z)
            out[impl] = (loss.detach(), grad)
        errors = {"loss": rel_err(out["triton"][0], out["torch"][0]), "grad": rel_err(out["triton"][1], out["torch"][1])}
        results[kind] = {"errors": errors, "tolerance": TOLERANCE, "ok": all(e <= TOLERANCE for e in errors.values())}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
