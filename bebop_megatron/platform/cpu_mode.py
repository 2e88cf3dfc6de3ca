"""CPU mode for Megatron-Core: the few CUDA-only calls it makes, redirected to the CPU.

Megatron-Core's TP, PP, EP, MTP and dist-checkpointing paths run on CPU with gloo once
these calls are redirected (DESIGN.md section 3). Every redirection is listed in
``REDIRECTIONS`` with a one-line reason; ``enable()`` installs them, ``disable()`` undoes
them. Nothing here is active unless ``device == "cpu"``.

``enable()`` also runs Megatron-Core's ``torch.compile``'d functions (``jit_fuser``: fused activations,
norms, the gated-attention output gate, the router) as written instead of compiled
(``lazy_imports.set_compile``): on CPU the inductor builds C++ for each function, input shape and
process, which needs a C++ compiler and takes seconds for element-wise functions that run in
microseconds (a 2-rank load of ten tiny converted models took twice as long with it).

``check_megatron_compatibility()`` verifies that every patched attribute still exists in
the installed Megatron-Core; a test calls it so that an upgrade that moves one fails loudly
instead of silently running CUDA code paths.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from bebop_megatron.platform import lazy_imports

__all__ = ["REDIRECTIONS", "enable", "disable", "is_enabled", "check_megatron_compatibility"]


@dataclass(frozen=True)
class Redirection:
    module: str  # dotted module path
    attr: str  # attribute path inside the module ("Tensor.cuda" allowed)
    reason: str
    make: Callable[[Any], Any]  # original -> replacement


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an int device means a CUDA ordinal (torch.cuda.current_device())
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_TENSOR_CUDA, _TENSOR_TYPE, _TENSOR_TO = torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in tensor factories, ``.to()`` and ``.cuda()``, and
    drops ``pin_memory=True`` (it needs a CUDA driver).

    Also reports CPU tensors' ``Tensor.type()`` under their CUDA names, because Megatron's
    optimizers assert ``'torch.cuda.FloatTensor'`` and friends.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Called for every torch function and tensor attribute read: the common case (no
        # keyword arguments, not one of the three methods below) costs four tests.
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            # Megatron's optimizers and grad clipping assert CUDA type names.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        if func is _TENSOR_TO and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if not kwargs:
            return func(*args)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # pinned host memory needs a CUDA driver (rope_utils' CP index)
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


class _NullEvent:
    """Stands in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_NULL_STREAM = _NullStream()
_CPU = torch.device("cpu")


def _cpu_rng_get(*args, **kwargs):
    return torch.get_rng_state()


def _cpu_rng_set(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


def _cpu_to_numpy(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _keep(value):
    return lambda original: value


REDIRECTIONS: tuple[Redirection, ...] = (
    Redirection("torch.cuda", "current_device",
                "Megatron passes current_device() as a device, also in backward passes where no mode is active",
                _keep(lambda: _CPU)),
    Redirection("torch.cuda", "current_stream",
                "streams order CUDA kernels; CPU ops are synchronous", _keep(lambda *a, **k: _NULL_STREAM)),
    Redirection("torch.cuda", "default_stream",
                "streams order CUDA kernels; CPU ops are synchronous", _keep(lambda *a, **k: _NULL_STREAM)),
    Redirection("torch.cuda", "Stream", "side streams (MoE D2H, DDP overlap) have no CPU meaning",
                _keep(_NullStream)),
    Redirection("torch.cuda", "Event", "events time or order CUDA streams only", _keep(_NullEvent)),
    Redirection("torch.cuda", "stream", "stream context managers become no-ops",
                _keep(lambda *a, **k: contextlib.nullcontext())),
    Redirection("torch.cuda", "synchronize", "nothing to wait for on CPU", _keep(lambda *a, **k: None)),
    Redirection("torch.cuda", "manual_seed",
                "the model-parallel RNG tracker seeds the CUDA generator; use the CPU one",
                _keep(torch.manual_seed)),
    Redirection("torch.cuda", "get_rng_state", "the RNG tracker saves CUDA RNG state; use the CPU one",
                _keep(_cpu_rng_get)),
    Redirection("torch.cuda", "set_rng_state", "the RNG tracker restores CUDA RNG state; use the CPU one",
                _keep(_cpu_rng_set)),
    Redirection("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
                "tensor_parallel.random forks CUDA RNG states for TP/EP init and dropout",
                _keep(_cpu_rng_get)),
    Redirection("megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
                "tensor_parallel.random forks CUDA RNG states for TP/EP init and dropout",
                _keep(_cpu_rng_set)),
    Redirection("torch.Tensor", "record_stream", "stream bookkeeping for the caching allocator only",
                _keep(lambda self, stream: None)),
    Redirection("torch.nn.Module", "cuda", "Module.cuda() moves parameters to the GPU; stay on CPU",
                _keep(lambda self, device=None: self)),
    Redirection("megatron.core.transformer.moe.moe_utils", "te_general_gemm",
                "router GEMM through TE; None selects Megatron's torch fallback", _keep(None)),
    Redirection("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
                "alltoall dispatcher needs host split sizes; CPU tensors are never converted",
                _cpu_to_numpy),
)

_CLASS_OWNERS = {"torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module}
_saved: dict[tuple[str, str], tuple[Any, bool]] = {}  # -> (original, was own attribute)
_mode: _CpuDeviceMode | None = None
_compile_before = True  # lazy_imports' setting before enable()


def _resolve(red: Redirection):
    return _CLASS_OWNERS.get(red.module) or importlib.import_module(red.module)


def check_megatron_compatibility() -> list[str]:
    """Return the redirections whose target no longer exists (empty when all are in place)."""
    missing = []
    for red in REDIRECTIONS:
        try:
            owner = _resolve(red)
        except ImportError:
            missing.append(f"{red.module} (module missing)")
            continue
        if not hasattr(owner, red.attr):
            missing.append(f"{red.module}.{red.attr}")
    return missing


class _DropRngWarning(logging.Filter):
    # With both RNG trackers mapped to the CPU generator, this warning is expected noise.
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_rng_filter = _DropRngWarning()


def enable() -> None:
    """Install every redirection and the device-rewriting mode, and run Megatron-Core's compiled
    functions uncompiled (idempotent)."""
    global _mode, _compile_before
    if _mode is not None:
        return
    missing = check_megatron_compatibility()
    if missing:
        raise RuntimeError(
            "CPU mode cannot patch this Megatron-Core version; missing: " + ", ".join(missing)
        )
    for red in REDIRECTIONS:
        owner = _resolve(red)
        original = getattr(owner, red.attr)
        _saved[(red.module, red.attr)] = (original, red.attr in vars(owner))
        setattr(owner, red.attr, red.make(original))
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_rng_filter)
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")  # a CUDA-stream hint
    _compile_before = lazy_imports.set_compile(False)
    _mode = _CpuDeviceMode()
    _mode.__enter__()


def disable() -> None:
    """Undo ``enable()``."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    for red in REDIRECTIONS:
        owner = _resolve(red)
        original, own = _saved.pop((red.module, red.attr))
        if own:
            setattr(owner, red.attr, original)
        else:  # it was inherited (e.g. Tensor.record_stream from TensorBase)
            delattr(owner, red.attr)
    logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_rng_filter)
    lazy_imports.set_compile(_compile_before)


def is_enabled() -> bool:
    return _mode is not None
