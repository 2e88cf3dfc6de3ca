"""Compile a Triton kernel of ``bebop_megatron/losses`` for sm_90 without a GPU (TTIR -> TTGIR ->
LLVM -> PTX -> cubin via ptxas): shared by tests/test_kernel_triton.py and tests/test_lk_triton.py."""

from __future__ import annotations

import pytest
import torch


def compile_sm90(kt, kernel, constexprs: dict, inp: str, comp: str) -> None:
    """Compile ``kernel`` of the kernel module ``kt`` with ``constexprs`` (``BLOCK_V`` added), the
    draft and target pointers of dtype ``inp``, ``arg_ptr`` int64 and the other pointers of dtype
    ``comp``; skips the test where this triton build cannot compile for CUDA, asserts a cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {"BLOCK_V": kt.BLOCK_V, **constexprs}
    num_warps = kt._Tiles(1, kt.BLOCK_V, torch.device("cpu")).num_warps
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("draft_ptr", "target_ptr"):
            signature[name] = "*" + inp
        elif name == "arg_ptr":
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*" + comp
        else:
            signature[name] = "i32"
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as err:  # e.g. a triton build without the NVIDIA backend or ptxas
        if "backend" in str(err).lower() or "ptxas" in str(err).lower():
            pytest.skip(f"cannot compile for CUDA here: {err}")
        raise
    assert compiled.asm.get("cubin"), f"{kernel.__name__} {constexprs} {inp}: no cubin"
