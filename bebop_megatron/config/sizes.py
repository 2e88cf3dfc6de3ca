"""Range checks of every size, count and coefficient that the main validation does not cover.

Each failure is one :class:`ConfigError` line naming the field, e.g. ``model.kv_channels=0
must be >= 1 (or null)``.
"""

from __future__ import annotations

import math

from bebop_megatron.config.errors import ConfigError
from bebop_megatron.config.schema import Config


def _at_least(value, name: str, low, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value is None or not math.isfinite(value) or value < low:
        raise ConfigError(f"{name}={value!r} must be >= {low}" + (" (or null)" if optional else ""))


def _above(value, name: str, low, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value is None or not math.isfinite(value) or value <= low:
        raise ConfigError(f"{name}={value!r} must be > {low}" + (" (or null)" if optional else ""))


def validate_sizes(cfg: Config) -> None:
    """Every size, count and coefficient not checked elsewhere: one line naming the field."""
    m, t = cfg.model, cfg.train
    for name in ("kv_channels", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "moe_router_num_groups", "moe_router_group_topk"):
        _at_least(getattr(m, name), f"model.{name}", 1, optional=True)
    for name in ("make_vocab_size_divisible_by", "max_position_embeddings", "yarn_original_max_position_embeddings"):
        _at_least(getattr(m, name), f"model.{name}", 1)
    for name in ("num_experts", "moe_first_dense_layers", "init_method_std", "moe_aux_loss_coeff", "yarn_mscale",
                 "yarn_mscale_all_dim"):
        _at_least(getattr(m, name), f"model.{name}", 0)
    for name in ("rotary_base", "norm_epsilon", "yarn_beta_fast", "yarn_beta_slow"):
        _above(getattr(m, name), f"model.{name}", 0)
    _above(m.moe_router_topk_scaling_factor, "model.moe_router_topk_scaling_factor", 0, optional=True)
    if m.moe_router_group_topk is not None and m.moe_router_num_groups is not None \
            and m.moe_router_group_topk > m.moe_router_num_groups:
        raise ConfigError(f"model.moe_router_group_topk={m.moe_router_group_topk} must be <= "
                          f"model.moe_router_num_groups={m.moe_router_num_groups}")
    _at_least(cfg.parallel.expert_tensor, "parallel.expert_tensor", 1, optional=True)
    for name in ("weight_decay", "adam_beta1", "adam_beta2"):
        _at_least(getattr(t, name), f"train.{name}", 0)
    for name in ("adam_beta1", "adam_beta2"):
        if getattr(t, name) >= 1:
            raise ConfigError(f"train.{name}={getattr(t, name)!r} must be < 1")
    _above(t.adam_eps, "train.adam_eps", 0)
    for name in ("lr", "min_lr", "clip_grad", "warmup_fraction"):
        if not math.isfinite(getattr(t, name)):
            raise ConfigError(f"train.{name}={getattr(t, name)!r} must be a finite number")
    _at_least(cfg.data.markov_branching, "data.markov_branching", 1)
    _at_least(cfg.data.markov_min_branching, "data.markov_min_branching", 1, optional=True)
    if cfg.data.markov_min_branching is not None and cfg.data.markov_min_branching > cfg.data.markov_branching:
        raise ConfigError(f"data.markov_min_branching={cfg.data.markov_min_branching} must be <= "
                          f"data.markov_branching={cfg.data.markov_branching}")
