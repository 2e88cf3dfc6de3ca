"""Checks of the Qwen3-Next / Qwen3.5 hybrid fields (``model.layer_types`` and friends)."""

from __future__ import annotations

LAYER_TYPES = ("full_attention", "linear_attention")


def has_linear_attention(m) -> bool:
    return bool(m.layer_types) and "linear_attention" in m.layer_types


def validate_hybrid(cfg) -> None:
    from bebop_megatron.config.errors import ConfigError

    m, p = cfg.model, cfg.parallel
    if m.layer_types is None:
        return
    types = list(m.layer_types)
    if len(types) != m.num_layers:
        raise ConfigError(f"model.layer_types has {len(types)} entries; model.num_layers={m.num_layers}")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise ConfigError(f"model.layer_types: unknown {bad[0]!r} (choose from {', '.join(LAYER_TYPES)})")
    if "linear_attention" not in types:
        return
    if m.multi_latent_attention:
        raise ConfigError("model.layer_types with linear_attention needs GQA attention "
                          "(model.multi_latent_attention=false)")
    for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be >= 1")
    if m.linear_num_value_heads % m.linear_num_key_heads:
        raise ConfigError(f"model.linear_num_value_heads={m.linear_num_value_heads} must be a multiple of "
                          f"model.linear_num_key_heads={m.linear_num_key_heads}")
    if m.linear_num_key_heads % p.tensor:
        raise ConfigError(f"parallel.tensor={p.tensor} must divide model.linear_num_key_heads={m.linear_num_key_heads}")
    if m.linear_num_key_heads % (p.tensor * p.context):  # Megatron-Core's TransformerConfig asserts it
        raise ConfigError(f"parallel.tensor={p.tensor} x parallel.context={p.context} must divide "
                          f"model.linear_num_key_heads={m.linear_num_key_heads} (Megatron-Core's Gated DeltaNet check)")
    if m.transformer_impl == "transformer_engine":
        raise ConfigError("model.layer_types with linear_attention runs Megatron-Core's local modules only: "
                          "set model.transformer_impl=local (or auto)")
    if cfg.data.pack and p.sequence_parallel and (cfg.data.train_files or cfg.data.valid_files):
        # Each packed document runs alone through the Gated DeltaNet (model/hybrid.py), which needs
        # the whole sequence on every rank.
        raise ConfigError("data.pack=true with Gated DeltaNet layers (model.layer_types has linear_attention) "
                          "needs parallel.sequence_parallel=false: each packed document runs alone through "
                          "the recurrent layers; or set data.pack=false")
