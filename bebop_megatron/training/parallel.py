"""Process groups and seeds from the config (sizes are validated before any group exists)."""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel

from bebop_megatron.config import Config, parallel_sizes


def setup_parallel(cfg: Config, world_size: int) -> dict[str, int]:
    """Validate sizes against ``world_size``, then build Megatron's process groups and seed RNGs."""
    sizes = parallel_sizes(cfg, world_size)  # raises ValueError before any group is made
    p = cfg.parallel
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        context_parallel_size=p.context,
        expert_model_parallel_size=p.expert,
        expert_tensor_parallel_size=sizes["expert_tensor"],
    )
    seed_everything(cfg.train.seed)
    return sizes


def seed_everything(seed: int) -> None:
    """Same seed on every rank (data order, CPU init); Megatron derives per-TP/EP streams."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    # model_parallel_cuda_manual_seed may leave the CPU generator advanced in CPU mode; reset
    # it so that weight initialisation starts from the same state on every rank and layout.
    torch.manual_seed(seed)
