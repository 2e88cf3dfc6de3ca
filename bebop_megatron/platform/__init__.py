"""Device and backend selection: CUDA with NCCL, or CPU with gloo (Megatron-Core in CPU mode)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from bebop_megatron.platform import cpu_mode

__all__ = ["resolve_device", "init_distributed", "cpu_mode", "have_transformer_engine", "device_of",
           "close_distributed_at_exit", "cpu_model"]


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def resolve_device(device: str) -> str:
    """Turn ``auto|cpu|cuda`` into ``cpu`` or ``cuda``; a clear error when CUDA is missing."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} must be one of auto, cpu, cuda")
    return device


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising OSError
        return False
    return True


def init_distributed(device: str, timeout_minutes: int = 30) -> tuple[int, int]:
    """Initialise torch.distributed from the torchrun environment (or as a single process).

    Returns ``(rank, world_size)``. In CPU mode the gloo backend is used and Megatron-Core's
    CUDA-only calls are redirected (:mod:`bebop_megatron.platform.cpu_mode`).
    """
    if device == "cpu":
        cpu_mode.enable()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            # One process needs no rendezvous: an in-memory store, so no TCP port is raced for
            # (nor a MASTER_PORT inherited from a parent process taken).
            store = dist.HashStore()
        else:
            store = None  # torchrun's MASTER_ADDR / MASTER_PORT
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return dist.get_rank(), dist.get_world_size()


_closing_at_exit = False


def close_distributed_at_exit() -> None:
    """Destroy the process groups at interpreter exit (``atexit``), while the interpreter is intact.

    Reason: left to the interpreter's teardown, the groups' native threads outlived it in about 1
    of 5 quick starts: "terminate called without an active exception" (SIGABRT) after a successful
    run, exit status 1 or 134. The entry points (``bebop_megatron.cli.run_cli``) ask for it when
    every rank exits alike (success, an agreed error), where no collective can be in flight; an
    error on one rank alone leaves the groups to the process exit, as before.
    """
    global _closing_at_exit
    if _closing_at_exit or not dist.is_initialized():
        return
    _closing_at_exit = True
    import atexit

    atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def end_single_process() -> None:
    """Undo ``init_distributed("cpu")`` of a one-process conversion (``convert.megatron_io.build``):
    Megatron's parallel state, the process group of one and CPU mode, so that a CUDA run later
    in the same process starts as in a fresh one. Reason: CPU mode stays on after an in-process
    import and rewrites every CUDA device to the CPU (``torch.zeros(device="cuda")`` is a CPU
    tensor), so a model moved to "cuda" silently stays on the CPU."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()
    cpu_mode.disable()


def device_of(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
