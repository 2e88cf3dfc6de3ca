"""bebop_megatron/platform/lazy_imports.py: Megatron-Core imported without building torch.compile
wrappers or importing wandb, with the same compiled functions and deterministic flags."""

from __future__ import annotations

import subprocess
import sys

import torch

from bebop_megatron.platform import lazy_imports

PROBE = r"""
import importlib.util, json, sys
import bebop_megatron  # installs the finder
import torch
import megatron.core.jit as jit
import megatron.core.timers as timers
import megatron.core.transformer.moe.router as router
import megatron.core.fusions.fused_bias_geglu as geglu
from bebop_megatron.platform.lazy_imports import lazy_compile
from bebop_megatron.training.trainer import Trainer  # noqa: F401  (everything a run imports)
seen = {"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
        "wandb_imported": "wandb" in sys.modules, "timers_wandb": timers.wandb is None,
        "jit_fuser_lazy": jit.jit_fuser is lazy_compile, "compile_restored": torch.compile.__module__ == "torch",
        "geglu_wrapped": geglu.geglu.__wrapped__.__name__ == "geglu",
        "router_wrapped": router.InferenceTopKRouter._compiled_topk_routing.__wrapped__.__name__,
        "wandb_installed": importlib.util.find_spec("wandb") is not None}
if seen["wandb_installed"]:
    import wandb  # still importable afterwards: only megatron.core.timers ran without it
    seen["wandb_after"] = hasattr(wandb, "init")
print(json.dumps(seen))
"""


def test_importing_megatron_builds_no_compile_wrapper_and_hides_wandb_from_timers_only():
    import json

    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["dynamo"] is False and seen["inductor"] is False, seen
    assert seen["wandb_imported"] is False and seen["timers_wandb"] is True, seen
    assert seen["jit_fuser_lazy"] and seen["compile_restored"] and seen["geglu_wrapped"], seen
    assert seen["router_wrapped"] == "_compiled_topk_routing", seen
    if seen["wandb_installed"]:
        assert seen["wandb_after"] is True


def test_lazy_compile_builds_torch_compile_once_at_the_first_call(monkeypatch):
    built = []
    real = torch.compile

    def recording(fn, **options):
        built.append(options)
        return real(fn, **options)

    def gelu_gate(y):
        a, b = torch.chunk(y, 2, -1)
        return torch.nn.functional.gelu(a, approximate="tanh") * b

    monkeypatch.setattr(torch, "compile", recording)
    lazy = lazy_imports.lazy_compile(gelu_gate, backend="eager")
    factory = lazy_imports.lazy_compile(backend="eager")(gelu_gate)  # the @torch.compile(...) form
    assert built == [] and lazy.__wrapped__ is gelu_gate
    y = torch.randn(3, 8, dtype=torch.float64)
    for fn in (lazy, factory, lazy):
        torch.testing.assert_close(fn(y), gelu_gate(y), rtol=0, atol=0)
    assert built == [{"backend": "eager"}, {"backend": "eager"}]  # once per function, with its options


def test_deterministic_flag_without_the_inductor_then_set_when_compiling(monkeypatch):
    import torch._inductor.config as inductor_config

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    monkeypatch.setattr(inductor_config, "deterministic", False)
    try:
        lazy_imports.use_deterministic_algorithms(warn_only=True)
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert inductor_config.deterministic is True  # already imported here: set directly
        inductor_config.deterministic = False
        lazy_imports.lazy_compile(torch.neg, backend="eager")(torch.ones(2))
        assert inductor_config.deterministic is True  # as torch.use_deterministic_algorithms would
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
