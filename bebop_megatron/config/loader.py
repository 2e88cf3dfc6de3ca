"""Load and validate configs: embedded defaults < YAML file < dotted CLI overrides."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, Iterable, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from bebop_megatron.config.checkpoints import validate_checkpoints
from bebop_megatron.config.errors import ConfigError
from bebop_megatron.config.hybrid import has_linear_attention
from bebop_megatron.config.outputs import validate_outputs
from bebop_megatron.config.schema import Config
from bebop_megatron.config.sizes import validate_sizes
from bebop_megatron.config.sources import single_source_as_list, validate_data
from bebop_megatron.config.yaml_file import default_save_dir, read_config_file
from bebop_megatron.losses.objectives import NAMES as OBJECTIVE_NAMES


def _known_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys.append(name)
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            keys += _known_keys(f.default_factory, name + ".")
    return keys


def _did_you_mean(key: str) -> str:
    match = difflib.get_close_matches(key, _known_keys(Config), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _friendly(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    if isinstance(err, ConfigKeyError):
        return ConfigError(f"unknown config key '{key}'{_did_you_mean(str(key))}")
    msg = str(err).splitlines()[0]
    if "is not a ListConfig" in msg:  # a scalar given for a list field
        return ConfigError(f"config field '{key}' is a list: write [{getattr(err, 'value', '...')}]")
    return ConfigError(f"config field '{key}': {msg}")


_SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.default_factory is not dataclasses.MISSING)


def _check_sections(layer) -> None:
    """A whole section replaced by a scalar (``train=3``): OmegaConf's error has no key."""
    for name in _SECTIONS:
        if name in layer and not OmegaConf.is_dict(layer[name]) and not isinstance(layer[name], dict):
            raise ConfigError(f"config field '{name}' is a section; set its fields, e.g. '{name}.<field>=...'")


def _leaf_types(cls, prefix: str = ""):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            yield from _leaf_types(f.default_factory, prefix + f.name + ".")
        else:
            yield prefix + f.name, f.type


_STRING_FIELDS = {key for key, kind in _leaf_types(Config) if kind in ("str", "Optional[str]")}
_YAML_BOOLEANS = {"yes", "no", "on", "off", "true", "false"}  # YAML 1.1, any case
_UNSET = object()


def _quote_string_override(item: str) -> str:
    """``train.resume=yes`` stays the string 'yes' (YAML would read a boolean, reported as 'True')."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, value = item.split("=", 1)
    if not key.strip():  # OmegaConf reported "unknown config key '?'"
        raise ConfigError(f"override '{item}' has no key before '=': write key=value, e.g. train.steps=100")
    if any(not part.strip() for part in key.split(".")):  # 'train.=3', '.x=3': an empty part of the key
        raise ConfigError(f"override '{item}': the key '{key}' has an empty part between its dots; write the "
                          "dotted field name, e.g. train.steps=100")
    if key in _STRING_FIELDS and value.strip().lower() in _YAML_BOOLEANS:
        return f"{key}='{value.strip()}'"
    return item


def _override_layer(item: str):
    """One ``key=value`` override as a config layer; a value YAML cannot parse is one line naming the
    override (it was yaml's multi-line ParserError, e.g. for ``data.train_files=[unclosed``)."""
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"override '{item}': its value is not valid YAML ({problem}); a list is written "
                          "[a, b], and a value holding YAML's [ ] { } : # or a quote is quoted, e.g. "
                          "key='a: b'") from None


def _check_string_fields(layer, where: str) -> None:
    for key in sorted(_STRING_FIELDS):
        value = OmegaConf.select(layer, key, default=None)
        if isinstance(value, bool):
            raise ConfigError(
                f"{where}config field '{key}' is a string, but YAML reads the unquoted word as the boolean "
                f"{str(value).lower()} (yes/no/on/off/true/false); quote it"
            )


@functools.lru_cache(maxsize=1)
def _schema():
    """``OmegaConf.structured(Config)``, built once (about 0.1 s of CPU: most of a ``load_config``);
    ``OmegaConf.merge`` copies its first argument and never changes it."""
    return OmegaConf.structured(Config)


def load_config(
    path: Optional[str] = None,
    overrides: Iterable[str] = (),
    defaults: Optional[dict[str, Any]] = None,
) -> Config:
    """Build a validated :class:`Config`.

    ``defaults`` (a nested dict) sits between the dataclass defaults and the YAML file. A YAML
    file that does not set ``save.dir`` gets ``checkpoints/<file stem>``. Raises
    :class:`ConfigError` (a ``ValueError``) naming the offending field.
    """
    base = _schema()
    try:
        layers = [base]
        if defaults:
            layers.append(OmegaConf.create(defaults))
        if path is not None:
            layer = read_config_file(path)
            _check_sections(layer)
            _check_string_fields(layer, f"config file {path}: ")
            if OmegaConf.select(layer, "save.dir", default=_UNSET) is _UNSET:
                # A config's run must not share the quick-start's checkpoints/tiny (and resume from it).
                layers.append(OmegaConf.create({"save": {"dir": default_save_dir(path)}}))
            layers.append(layer)
        overrides = [_quote_string_override(item) for item in overrides]
        if overrides:
            layers.append(OmegaConf.merge(*[_override_layer(item) for item in overrides]))
        for layer in layers[1:]:
            _check_sections(layer)
            single_source_as_list(layer)
        merged = OmegaConf.merge(*layers)
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _friendly(err) from None
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


LOSS_TYPES = OBJECTIVE_NAMES  # the objective registry's names (bebop_megatron/losses/objectives.py)


def _choice(value, name: str, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} must be one of {', '.join(map(str, choices))}")


def _positive(value, name: str) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{name}={value!r} must be >= 1")


TEMPERATURE_RANGE = (1e-3, 1e3)
"""Allowed ``loss.target_temperature`` / ``loss.draft_temperature``."""


def _validate_context_parallel(cfg) -> None:
    """``parallel.context = C > 1``: the SDPA backend's own CP attention (model/cp_attention.py)
    and the MTP loss over the shards; the combinations not built or tested are refused."""
    m, p, t, C = cfg.model, cfg.parallel, cfg.train, cfg.parallel.context
    pre = f"parallel.context={C}"
    if t.seq_length % (2 * C):
        raise ConfigError(f"{pre} needs train.seq_length={t.seq_length} divisible by 2 * parallel.context = {2 * C} "
                          "(each row is split into 2C chunks)")
    if t.seq_length // (2 * C) < cfg.mtp.num_steps:
        raise ConfigError(f"{pre}: each of the 2C chunks of a row (train.seq_length / {2 * C}) must hold at least "
                          f"mtp.num_steps={cfg.mtp.num_steps} positions")
    if m.transformer_impl == "transformer_engine":
        raise ConfigError(f"{pre} runs with the local layers only (model.transformer_impl=local or auto)")
    if m.attention_backend != "sdpa":
        raise ConfigError(f"{pre} needs model.attention_backend=sdpa (the unfused attention has no CP)")
    if has_linear_attention(m) and p.sequence_parallel:
        raise ConfigError(f"{pre}: Gated DeltaNet layers (model.layer_types with linear_attention) gather whole "
                          "rows over the CP group and take no sequence-parallel shards; "
                          "set parallel.sequence_parallel=false")


def validate(cfg: Config) -> None:
    """Checks that need no process group. World-size checks live in ``parallel_sizes``."""
    m, p, t, mtp = cfg.model, cfg.parallel, cfg.train, cfg.mtp
    _choice(cfg.device, "device", ("auto", "cpu", "cuda"))
    _choice(cfg.precision, "precision", ("fp32", "bf16", "fp8"))
    _choice(m.family, "model.family", ("dense", "moe"))
    _choice(m.transformer_impl, "model.transformer_impl", ("auto", "local", "transformer_engine"))
    _choice(m.attention_backend, "model.attention_backend", ("sdpa", "unfused"))
    _choice(m.moe_token_dispatcher_type, "model.moe_token_dispatcher_type", ("alltoall", "allgather"))
    _choice(cfg.loss.type, "loss.type", LOSS_TYPES)
    if not cfg.loss.lk_eta > 0 or cfg.loss.lk_eta == float("inf"):
        raise ConfigError(f"loss.lk_eta={cfg.loss.lk_eta!r} must be a finite number > 0")
    for name in ("target_temperature", "draft_temperature"):
        value = getattr(cfg.loss, name)
        if not TEMPERATURE_RANGE[0] <= value <= TEMPERATURE_RANGE[1]:  # NaN fails too
            raise ConfigError(f"loss.{name}={value!r} must be in [{TEMPERATURE_RANGE[0]:g}, {TEMPERATURE_RANGE[1]:g}] "
                              "(the logits are divided by it; beyond that range the softmax overflows)")
    _positive(cfg.loss.chunk_tokens, "loss.chunk_tokens")
    _choice(cfg.loss.impl, "loss.impl", ("torch", "triton"))
    if cfg.loss.impl == "triton" and cfg.device == "cpu":
        raise ConfigError("loss.impl=triton runs on CUDA only; use loss.impl=torch with device=cpu")
    _choice(t.lr_schedule, "train.lr_schedule", ("constant", "cosine"))
    _choice(t.resume, "train.resume", ("auto", "none"))
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "vocab_size"):
        _positive(getattr(m, name), f"model.{name}")
    for name in ("tensor", "pipeline", "expert", "context"):
        _positive(getattr(p, name), f"parallel.{name}")
    if m.padded_vocab_size is not None:
        if m.padded_vocab_size < m.vocab_size or m.padded_vocab_size % p.tensor:
            raise ConfigError(
                f"model.padded_vocab_size={m.padded_vocab_size} must be >= model.vocab_size={m.vocab_size} "
                f"and divisible by parallel.tensor={p.tensor}"
            )
    for name in ("steps", "micro_batch_size", "global_batch_size", "seq_length"):
        _positive(getattr(t, name), f"train.{name}")
    _positive(mtp.num_layers, "mtp.num_layers")
    _positive(mtp.num_steps, "mtp.num_steps")
    if t.seq_length <= mtp.num_steps:  # step k at position t predicts token t+k+1 of the same row
        raise ConfigError(f"train.seq_length={t.seq_length} must be > mtp.num_steps={mtp.num_steps}: MTP step k "
                          "trains only on positions whose token k+1 ahead is in the row, so with rows this short "
                          "the last steps train on nothing")
    validate_sizes(cfg)
    if t.seq_length > m.max_position_embeddings and not t.allow_beyond_max_positions:
        raise ConfigError(f"train.seq_length={t.seq_length} is above model.max_position_embeddings="
                          f"{m.max_position_embeddings}: lower it, or set train.allow_beyond_max_positions=true "
                          "to extrapolate RoPE past the positions the backbone was trained on")
    _choice(mtp.next_step_input, "mtp.next_step_input", ("pre_norm", "post_norm"))
    _choice(m.backbone_init, "model.backbone_init", ("random", "fit_synthetic"))
    _choice(mtp.init, "mtp.init", ("auto", "random", "copy_last_layer", "identity"))
    if mtp.num_layers not in (1, mtp.num_steps):
        raise ConfigError(
            f"mtp.num_layers={mtp.num_layers} must equal mtp.num_steps={mtp.num_steps} "
            "(one layer per step) or be 1 (one layer reused for every step)"
        )
    if not 0.0 < m.rotary_percent <= 1.0:
        raise ConfigError(f"model.rotary_percent={m.rotary_percent} must be in (0, 1]")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={m.num_query_groups} must divide "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
    _validate_mla(cfg)
    from bebop_megatron.config.hybrid import validate_hybrid

    validate_hybrid(cfg)
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads and not m.multi_latent_attention:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; set model.kv_channels"
        )
    if m.num_query_groups % p.tensor:
        raise ConfigError(
            f"parallel.tensor={p.tensor} must divide model.num_query_groups={m.num_query_groups}"
        )
    if m.ffn_hidden_size % p.tensor:
        raise ConfigError(f"parallel.tensor={p.tensor} must divide model.ffn_hidden_size={m.ffn_hidden_size}")
    if m.family == "moe":
        if m.num_experts < 2:
            raise ConfigError(f"model.num_experts={m.num_experts} must be >= 2 for model.family=moe")
        if not 1 <= m.moe_router_topk <= m.num_experts:
            raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} must be in [1, model.num_experts]")
        _choice(m.moe_router_score_function, "model.moe_router_score_function", ("softmax", "sigmoid"))
        if not 0 <= m.moe_first_dense_layers < m.num_layers:
            raise ConfigError(f"model.moe_first_dense_layers={m.moe_first_dense_layers} must be in [0, model.num_layers)")
        if m.num_experts % p.expert:
            raise ConfigError(f"parallel.expert={p.expert} must divide model.num_experts={m.num_experts}")
        if p.tensor > 1 and not p.sequence_parallel:
            raise ConfigError(  # Megatron-Core's own rule for MoE training
                f"parallel.tensor={p.tensor} with model.family=moe needs parallel.sequence_parallel=true"
            )
    else:
        if p.expert > 1:
            raise ConfigError(f"parallel.expert={p.expert} needs model.family=moe (a dense model has no experts)")
        if m.num_experts:
            raise ConfigError(f"model.num_experts={m.num_experts} needs model.family=moe")
    if p.sequence_parallel and p.tensor == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor > 1")
    if p.sequence_parallel and t.seq_length % p.tensor:
        raise ConfigError(f"parallel.tensor={p.tensor} must divide train.seq_length={t.seq_length} with sequence_parallel")
    if p.context > 1:
        _validate_context_parallel(cfg)
    if p.pipeline_layout is not None:
        _validate_pipeline_layout(cfg)
    if p.pipeline > 1 and p.pipeline_layout is None and m.num_layers % p.pipeline:
        raise ConfigError(
            f"parallel.pipeline={p.pipeline} must divide model.num_layers={m.num_layers} "
            "(or give parallel.pipeline_layout)"
        )
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}"
        )
    if not 0.0 <= t.warmup_fraction < 1.0:
        raise ConfigError(f"train.warmup_fraction={t.warmup_fraction} must be in [0, 1)")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"train.lr={t.lr} / train.min_lr={t.min_lr}: need 0 <= min_lr <= lr, lr > 0")
    if t.clip_grad < 0:
        raise ConfigError(f"train.clip_grad={t.clip_grad} must be >= 0")
    if m.backbone_checkpoint and m.init_checkpoint:
        raise ConfigError("model.backbone_checkpoint and model.init_checkpoint are exclusive")
    validate_checkpoints(cfg)
    if cfg.precision == "fp8" and m.transformer_impl == "local":
        raise ConfigError("precision=fp8 needs model.transformer_impl=transformer_engine (or auto)")
    if cfg.save.overwrite and t.resume != "none":
        raise ConfigError("save.overwrite=true deletes the checkpoints in save.dir: it needs train.resume=none")
    if cfg.save.interval < 0:
        raise ConfigError(f"save.interval={cfg.save.interval} must be >= 0")
    if t.log_interval < 1:
        raise ConfigError(f"train.log_interval={t.log_interval} must be >= 1")
    _validate_production(cfg)
    if cfg.eval.interval < 0:
        raise ConfigError(f"eval.interval={cfg.eval.interval} must be >= 0")
    if cfg.eval.max_samples < 0:
        raise ConfigError(f"eval.max_samples={cfg.eval.max_samples} must be >= 0")
    validate_data(cfg)


def _validate_mla(cfg: Config) -> None:
    """Multi-Latent Attention fields (DeepSeek-V3)."""
    m, tp = cfg.model, cfg.parallel.tensor
    mla_fields = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    if not m.multi_latent_attention:
        for name in mla_fields:
            if getattr(m, name) is not None:
                raise ConfigError(f"model.{name}={getattr(m, name)} needs model.multi_latent_attention=true")
        if m.rope_type != "rope":
            raise ConfigError(f"model.rope_type={m.rope_type!r} needs model.multi_latent_attention=true")
        return
    for name in mla_fields[1:]:
        _positive(getattr(m, name), f"model.{name}")
    if m.q_lora_rank is not None:
        _positive(m.q_lora_rank, "model.q_lora_rank")
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"model.qk_pos_emb_head_dim={m.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")
    if m.num_query_groups != m.num_attention_heads:
        raise ConfigError(f"model.num_query_groups={m.num_query_groups} must equal model.num_attention_heads="
                          f"{m.num_attention_heads} with model.multi_latent_attention=true")
    _choice(m.rope_type, "model.rope_type", ("rope", "yarn"))
    if m.rope_type == "yarn" and m.yarn_scaling_factor < 1.0:
        raise ConfigError(f"model.yarn_scaling_factor={m.yarn_scaling_factor} must be >= 1")
    if m.rotary_percent != 1.0:
        raise ConfigError(f"model.rotary_percent={m.rotary_percent} must be 1 with model.multi_latent_attention=true "
                          "(set the rotated width with model.qk_pos_emb_head_dim)")
    # The local MLA spec splits the down projections' outputs over TP ranks.
    if m.q_lora_rank is not None and m.q_lora_rank % tp:
        raise ConfigError(f"parallel.tensor={tp} must divide model.q_lora_rank={m.q_lora_rank}")
    if (m.kv_lora_rank + m.qk_pos_emb_head_dim) % tp:
        raise ConfigError(f"parallel.tensor={tp} must divide model.kv_lora_rank + model.qk_pos_emb_head_dim = "
                          f"{m.kv_lora_rank + m.qk_pos_emb_head_dim}")


def _validate_production(cfg: Config) -> None:
    """Numerics guard, checkpoint retention, FP8 recipe and logging fields."""
    t, s, f, w = cfg.train, cfg.save, cfg.fp8, cfg.logging.wandb
    if t.max_skipped_steps < 1:
        raise ConfigError(f"train.max_skipped_steps={t.max_skipped_steps} must be >= 1")
    if s.keep_last < 0:
        raise ConfigError(f"save.keep_last={s.keep_last} must be >= 0 (0 keeps every checkpoint)")
    _choice(f.recipe, "fp8.recipe", ("delayed", "tensorwise", "mxfp8", "blockwise"))
    _choice(f.format, "fp8.format", ("hybrid", "e4m3"))
    _choice(f.amax_compute_algo, "fp8.amax_compute_algo", ("max", "most_recent"))
    _positive(f.amax_history_len, "fp8.amax_history_len")
    _choice(w.mode, "logging.wandb.mode", ("online", "offline", "disabled"))
    if not w.project:
        raise ConfigError("logging.wandb.project must not be empty")
    peak = cfg.logging.peak_tflops
    if peak is not None and peak <= 0:
        raise ConfigError(f"logging.peak_tflops={peak} must be > 0 (or null)")
    validate_outputs(cfg)


def _validate_pipeline_layout(cfg: Config) -> None:
    """Megatron's own layout checks, turned into one-line errors before any group exists."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    p, K = cfg.parallel, cfg.mtp.num_steps
    hint = f"e.g. 'Et*{cfg.model.num_layers}|m*{K}L' for a standalone MTP stage with pipeline=2"
    if p.pipeline == 1:
        raise ConfigError("parallel.pipeline_layout needs parallel.pipeline > 1")
    try:
        layout = PipelineParallelLayerLayout(p.pipeline_layout, p.pipeline)
        layout.validate_layer_layout(num_layers=cfg.model.num_layers, mtp_num_layers=K)
    except (AssertionError, ValueError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"parallel.pipeline_layout={p.pipeline_layout!r} is invalid: {reason} "
            f"(one 'm' per MTP step, mtp.num_steps={K}; {hint})"
        ) from None
    if LayerType.mtp not in layout.layout[-1][-1]:
        raise ConfigError(
            f"parallel.pipeline_layout={p.pipeline_layout!r}: the MTP layers must be on the last "
            f"pipeline stage, with the loss ({hint})"
        )


def parallel_sizes(cfg: Config, world_size: int) -> dict[str, int]:
    """Data-parallel size and the rest, validated against the world size (no process groups)."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor * p.pipeline * p.context
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor * parallel.pipeline * "
            f"parallel.context = {model_parallel}; launch with a multiple of {model_parallel} ranks "
            f"(e.g. torchrun --nproc_per_node {model_parallel}) or lower the parallel sizes"
        )
    dp = world_size // model_parallel
    etp = p.expert_tensor if p.expert_tensor is not None else p.tensor
    if (dp * p.tensor * p.context) % (p.expert * etp):
        raise ConfigError(
            f"parallel.expert={p.expert} * parallel.expert_tensor={etp} must divide the "
            f"data * tensor * context size {dp * p.tensor * p.context}"
        )
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size * data-parallel size = {t.micro_batch_size * dp}"
        )
    return {
        "data": dp,
        "expert_tensor": etp,
        "num_microbatches": t.global_batch_size // (t.micro_batch_size * dp),
    }
