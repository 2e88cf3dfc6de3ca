"""A Megatron-Core process group of one inside a pytest process, left as it was found."""

from __future__ import annotations

import contextlib
import os

ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def tear_down() -> None:
    """Destroy Megatron-Core's parallel state and the process group, and leave CPU mode: what an
    in-process import or trainer sets up, so that later tests in the worker start clean."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bebop_megatron.platform import cpu_mode

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    cpu_mode.disable()


@contextlib.contextmanager
def single_process():
    """A single process whatever the environment (torchrun's variables removed, then restored),
    torn down on exit (:func:`tear_down`)."""
    saved = {name: os.environ.pop(name, None) for name in ENV_NAMES}
    try:
        yield
    finally:
        tear_down()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
