"""Silence Megatron-Core's start-up notices that say nothing about this run.

Each entry is a message that Megatron-Core or torch prints on every start on machines
without Transformer Engine/apex (expected here: the fallbacks are what we select) or
about APIs we do not use. Nothing else is filtered.
"""

from __future__ import annotations

import logging
import warnings

_WARNINGS = (
    r"Transformer Engine and Apex are not installed",  # we select the torch fallbacks on purpose
    r"Apex is not installed",  # same: the local spec's norm is ours
    r"absl\.logging is not installed",
    r"full scope is deprecated",  # CUDA-graph default inside TransformerConfig; we set no graphs
    r"MimoModelConfig is experimental",  # imported by Megatron, unused here
    r"`torch.distributed.all_gather_into_tensor` is deprecated",  # Megatron's call, not ours
    # Loading a backbone checkpoint (e.g. the quick start's fitted one): torch's notes on
    # Megatron's dist-checkpointing calls and on reading metadata without a process group.
    r"torch\.distributed is disabled, unavailable or uninitialized",
    r"The argument order of load has been changed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)

_LOG_MESSAGES = (
    "GPTModel IS DEPRECATED",  # MTP with a GPT layer spec is built on GPTModel in 0.19
    "MCore's async save is deprecated",  # we save synchronously
    "No CUDA runtime is found",  # torch.utils.cpp_extension on CPU-only machines
)


class _DropKnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(m in message for m in _LOG_MESSAGES)


def install() -> None:
    for pattern in _WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    noise = _DropKnownNoise()
    for name in (
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.dist_checkpointing.strategies.torch",
        "torch.utils.cpp_extension",
    ):
        logging.getLogger(name).addFilter(noise)
