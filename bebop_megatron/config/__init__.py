"""Structured configuration (dataclasses + OmegaConf) and its validation."""

from bebop_megatron.config.loader import ConfigError, load_config, parallel_sizes, to_yaml, validate
from bebop_megatron.config.schema import (
    Config,
    DataConfig,
    LossConfig,
    ModelConfig,
    MTPConfig,
    ParallelConfig,
    SaveConfig,
    TrainConfig,
)

__all__ = [
    "Config", "ConfigError", "DataConfig", "LossConfig", "ModelConfig", "MTPConfig",
    "ParallelConfig", "SaveConfig", "TrainConfig", "load_config", "parallel_sizes", "to_yaml",
    "validate",
]
