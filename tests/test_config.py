"""Config loading and validation (bebop_megatron/config/loader.py, schema.py).

Every user error must be a single ``ConfigError`` (a ``ValueError``) whose one-line
message names the offending field, with no chained traceback behind it.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from bebop_megatron.config import (
    Config,
    ConfigError,
    ModelConfig,
    MTPConfig,
    ParallelConfig,
    SaveConfig,
    TrainConfig,
    load_config,
    parallel_sizes,
    to_yaml,
)

REPO = Path(__file__).resolve().parents[1]


def _assert_one_line_error(excinfo, *fields: str) -> str:
    err = excinfo.value
    assert isinstance(err, ValueError) and isinstance(err, ConfigError)
    msg = str(err)
    assert msg.strip(), "empty error message"
    assert "\n" not in msg, f"message is not a single line: {msg!r}"
    for name in fields:
        assert name in msg, f"{name!r} not named in {msg!r}"
    # One error, not a chain: nothing printed as "During handling of the above exception...".
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__
    return msg


# (overrides, fields the message must name)
BAD_OVERRIDES = [
    pytest.param(["parallel.tensor=3"], ["parallel.tensor"], id="tp-not-dividing-query-groups"),
    pytest.param(
        ["model.num_attention_heads=6", "model.num_query_groups=6", "model.hidden_size=192",
         "parallel.tensor=4"],
        ["parallel.tensor"],
        id="tp-not-dividing-heads-and-groups",
    ),
    pytest.param(["model.num_query_groups=3"], ["model.num_query_groups"], id="groups-not-dividing-heads"),
    pytest.param(["parallel.expert=2"], ["parallel.expert", "moe"], id="ep-without-moe"),
    pytest.param(["train.steps=abc"], ["train.steps"], id="wrong-type-int"),
    pytest.param(["model.qk_layernorm=maybe"], ["model.qk_layernorm"], id="wrong-type-bool"),
    pytest.param(["parallel.expert_tensor=abc"], ["parallel.expert_tensor"], id="wrong-type-optional-int"),
    pytest.param(["mtp.num_layers=2", "mtp.num_steps=3"], ["mtp.num_layers", "mtp.num_steps"],
                 id="mtp-layers-vs-steps"),
    # parallel.context > 1: the combinations not built or tested are refused (one line each)
    pytest.param(["parallel.context=2", "parallel.tensor=1", "model.attention_backend=unfused"],
                 ["parallel.context", "model.attention_backend"], id="context-parallel-unfused"),
    pytest.param(["parallel.context=2", "parallel.tensor=1", "train.seq_length=30"],
                 ["parallel.context", "train.seq_length"], id="context-parallel-seq-length"),
    pytest.param(["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                  "model.layer_types=[linear_attention,full_attention]", "model.num_layers=2"],
                 ["parallel.context", "Gated DeltaNet", "parallel.sequence_parallel"],
                 id="context-parallel-gated-deltanet-sp"),
    pytest.param(["parallel.context=2", "parallel.tensor=1", "model.layer_types=[linear_attention,full_attention]",
                  "model.num_layers=2", "model.linear_num_key_heads=1"],
                 ["parallel.context", "model.linear_num_key_heads"], id="context-parallel-gated-deltanet-heads"),
    pytest.param(["train.global_batch_size=6", "train.micro_batch_size=4"],
                 ["train.global_batch_size", "train.micro_batch_size"], id="gbs-not-multiple-of-mbs"),
    pytest.param(["precision=fp8", "model.transformer_impl=local"],
                 ["precision", "model.transformer_impl"], id="fp8-with-local"),
    pytest.param(["device=gpu"], ["device"], id="bad-choice"),
    pytest.param(["train.steps=0"], ["train.steps"], id="non-positive"),
    pytest.param(["train.stepz"], ["train.stepz"], id="override-without-equals"),
    pytest.param(["loss.type=lk", "loss.lk_eta=0"], ["loss.lk_eta"], id="lk-eta-zero"),
    pytest.param(["loss.lk_eta=-1.5"], ["loss.lk_eta"], id="lk-eta-negative"),
    pytest.param(["loss.lk_eta=inf"], ["loss.lk_eta"], id="lk-eta-inf"),
    pytest.param(["loss.lk_eta=nan"], ["loss.lk_eta"], id="lk-eta-nan"),
    pytest.param(["loss.lk_eta=abc"], ["loss.lk_eta"], id="lk-eta-wrong-type"),
    pytest.param(["loss.type=lk", "loss.impl=triton", "device=cpu"], ["loss.impl", "device"], id="lk-triton-on-cpu"),
    pytest.param(["loss.type=e2e_lk", "loss.impl=triton", "device=cpu"], ["loss.impl", "device"],
                 id="e2e-lk-triton-on-cpu"),
    pytest.param(["loss.type=nlaa"], ["loss.type"], id="bad-loss-type"),
]


@pytest.mark.parametrize("loss_type", ["nla", "e2e_nla", "lk", "e2e_lk"])
def test_cold_start_loss_types_load(loss_type):
    cfg = load_config(None, [f"loss.type={loss_type}", "loss.lk_eta=2.5"])
    assert cfg.loss.type == loss_type and cfg.loss.lk_eta == 2.5
    assert load_config(None, []).loss.lk_eta == 3.0
    # Both kernels run them all (lk / e2e_lk through the one-pass TV+KL kind); Triton on CUDA only.
    assert load_config(None, [f"loss.type={loss_type}", "loss.impl=triton", "device=cuda"]).loss.impl == "triton"


@pytest.mark.parametrize("overrides, fields", BAD_OVERRIDES)
def test_bad_override_gives_one_line_error_naming_field(overrides, fields):
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, overrides)
    _assert_one_line_error(excinfo, *fields)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["train.stepz=3"])
    msg = _assert_one_line_error(excinfo, "train.stepz")
    assert "did you mean 'train.steps'" in msg


def test_unknown_nested_key_suggestion_uses_full_path():
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["model.hiden_size=3"])
    msg = _assert_one_line_error(excinfo, "model.hiden_size")
    assert "did you mean 'model.hidden_size'" in msg


def test_unknown_key_without_close_match_has_no_suggestion():
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["zzzzzz=1"])
    msg = _assert_one_line_error(excinfo, "zzzzzz")
    assert "did you mean" not in msg


def test_unknown_key_in_yaml_and_in_defaults(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(str(path))
    assert "did you mean 'train.steps'" in _assert_one_line_error(excinfo, "train.stepz")
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, defaults={"train": {"stepz": 3}})
    assert "did you mean 'train.steps'" in _assert_one_line_error(excinfo, "train.stepz")


def test_wrong_type_in_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: [1, 2]\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(str(path))
    _assert_one_line_error(excinfo, "model.hidden_size")


def test_missing_yaml_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as excinfo:
        load_config(str(missing))
    _assert_one_line_error(excinfo, str(missing))


def test_section_replaced_by_scalar_names_the_section():
    # `train=3` replaces a whole section with a scalar; the error must still name 'train'.
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["train=3"])
    _assert_one_line_error(excinfo, "'train'")


def test_world_size_mismatch():
    cfg = load_config(None, ["parallel.tensor=2"])
    with pytest.raises(ConfigError) as excinfo:
        parallel_sizes(cfg, world_size=3)
    _assert_one_line_error(excinfo, "parallel.tensor", "3")


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    # Valid on its own (12 % 4 == 0) but DP=2 on 2 ranks needs a multiple of 4 * 2 = 8.
    cfg = load_config(None, ["train.global_batch_size=12", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError) as excinfo:
        parallel_sizes(cfg, world_size=2)
    _assert_one_line_error(excinfo, "train.global_batch_size", "train.micro_batch_size")


def test_expert_parallel_not_dividing_data_times_tensor():
    cfg = load_config(None, ["model.family=moe", "model.num_experts=4", "parallel.expert=4"])
    with pytest.raises(ConfigError) as excinfo:
        parallel_sizes(cfg, world_size=2)
    _assert_one_line_error(excinfo, "parallel.expert")


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        ([], 1, {"data": 1, "expert_tensor": 1, "num_microbatches": 2}),
        (["parallel.tensor=2"], 4, {"data": 2, "expert_tensor": 2, "num_microbatches": 1}),
        (["parallel.pipeline=2", "train.global_batch_size=32"], 8,
         {"data": 4, "expert_tensor": 1, "num_microbatches": 2}),
        (["model.family=moe", "model.num_experts=4", "parallel.expert=2", "parallel.expert_tensor=1",
          "parallel.tensor=2", "parallel.sequence_parallel=true"], 2,
         {"data": 1, "expert_tensor": 1, "num_microbatches": 2}),
    ],
)
def test_parallel_sizes_valid(overrides, world, expected):
    cfg = load_config(None, overrides)
    assert parallel_sizes(cfg, world) == expected


def test_precedence_dataclass_defaults_yaml_dotlist(tmp_path):
    defaults = {
        "device": "cpu",
        "parallel": {"tensor": 2},
        "train": {"steps": 7, "lr": 0.1, "seq_length": 48},
        "mtp": {"num_steps": 5},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  steps: 11\n  seq_length: 32\nmtp:\n  num_steps: 4\n")
    cfg = load_config(str(path), ["train.seq_length=16", "parallel.tensor=1"], defaults=defaults)

    assert cfg.device == "cpu"  # defaults over dataclass ("auto")
    assert cfg.train.lr == 0.1  # defaults over dataclass (1e-3)
    assert cfg.train.steps == 11  # YAML over defaults (7)
    assert cfg.mtp.num_steps == 4  # YAML over defaults (5)
    assert cfg.train.seq_length == 16  # dotlist over YAML (32) and defaults (48)
    assert cfg.parallel.tensor == 1  # dotlist over defaults (2)
    assert cfg.train.micro_batch_size == TrainConfig().micro_batch_size  # untouched: dataclass
    assert cfg.model == ModelConfig()  # a whole untouched section keeps the dataclass defaults

    # Each layer alone, for comparison.
    assert load_config(None, defaults=defaults).train.steps == 7
    assert load_config(str(path)).train.lr == TrainConfig().lr
    assert isinstance(cfg, Config) and isinstance(cfg.train, TrainConfig)


def test_loaded_types_are_python_types():
    cfg = load_config(None, ["train.lr=1", "train.steps=3", "parallel.sequence_parallel=true",
                             "parallel.tensor=2"])
    assert type(cfg.train.lr) is float and cfg.train.lr == 1.0
    assert type(cfg.train.steps) is int
    assert cfg.parallel.sequence_parallel is True


def test_to_yaml_round_trips(tmp_path):
    cfg = Config(
        device="cpu",
        precision="bf16",
        model=ModelConfig(family="moe", num_experts=4, kv_channels=16, qk_layernorm=True,
                          moe_shared_expert_intermediate_size=64, norm_epsilon=1e-5),
        mtp=MTPConfig(num_layers=2, num_steps=2, detach_heads=True),
        parallel=ParallelConfig(tensor=2, pipeline=2, expert=2, pipeline_layout="Et*4|m*2L",
                                sequence_parallel=True, distributed_optimizer=True),
        train=TrainConfig(steps=9, lr=3e-4, min_lr=1e-6, adam_eps=1e-8, lr_schedule="cosine",
                          resume="none"),
        save=SaveConfig(dir=None, interval=3),
    )
    cfg.data.seed = 99
    path = tmp_path / "rt.yaml"
    path.write_text(to_yaml(cfg))
    back = load_config(str(path))
    assert back == cfg
    # And the YAML of the reloaded config is byte-identical.
    assert to_yaml(back) == to_yaml(cfg)


def test_to_yaml_round_trips_strings_that_look_like_other_types(tmp_path):
    for weird in ("null", "123", "true", "1e-3"):
        cfg = Config(save=SaveConfig(dir=weird))
        path = tmp_path / "rt.yaml"
        path.write_text(to_yaml(cfg))
        assert load_config(str(path)).save.dir == weird


def test_default_config_round_trips(tmp_path):
    path = tmp_path / "rt.yaml"
    path.write_text(to_yaml(Config()))
    assert load_config(str(path)) == Config()
    assert load_config(None) == Config()


def _embedded_default() -> dict:
    # Read the literal from the source: importing the example would import the trainer
    # (and Megatron-Core), which is slow and not what this test is about.
    tree = ast.parse((REPO / "examples" / "pretrain_mtp.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "EMBEDDED_DEFAULT" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("EMBEDDED_DEFAULT not found in examples/pretrain_mtp.py")


def test_example_embedded_default_is_a_valid_two_rank_config():
    embedded = _embedded_default()
    cfg = load_config(None, defaults=embedded)
    assert cfg.device == "cpu" and cfg.parallel.tensor == 2
    assert parallel_sizes(cfg, world_size=2)["data"] == 1
    # docs/configuration.md: `parallel.tensor=1` is a valid single-process run.
    single = load_config(None, ["parallel.tensor=1"], defaults=embedded)
    assert parallel_sizes(single, world_size=1)["data"] == 1


def test_tiny_cpu_yaml_is_the_embedded_default_spelled_out():
    # examples/configs/tiny_cpu.yaml says so in its header: it must resolve to the same run
    # (it once had a random backbone and other synthetic data: step-1 loss 0.2281 vs 0.9358).
    spelled_out = load_config(str(REPO / "examples" / "configs" / "tiny_cpu.yaml"))
    assert spelled_out == load_config(None, defaults=_embedded_default())


def test_every_schema_field_is_reachable_by_override():
    # Every leaf field can be set with a dotted override (names match the schema).
    def leaves(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from leaves(value, prefix + f.name + ".")
            else:
                yield prefix + f.name, value

    for key, value in leaves(Config()):
        rendered = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        cfg = load_config(None, [f"{key}={rendered}"])
        assert cfg == Config(), key


def test_moe_with_tensor_parallel_needs_sequence_parallel():
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["model.family=moe", "model.num_experts=4", "parallel.tensor=2"])
    _assert_one_line_error(excinfo, "parallel.sequence_parallel")
