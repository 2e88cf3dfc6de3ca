"""Config files and values that used to give a traceback or a misleading message
(bebop_megatron/config/yaml_file.py, sizes.py, loader.py):

- a YAML file that is a directory, a list, binary, not UTF-8, has a syntax error or a duplicate
  key: one ``ConfigError`` line naming the file (and the line), exit status 2 from the CLI;
- every size field out of range (``model.kv_channels=0`` ...): one line naming the field;
- ``train.resume=yes`` is reported as 'yes', not 'True'; an unquoted ``yes`` in a file's
  string field says that YAML read a boolean;
- ``--config FILE`` without ``save.dir`` gets ``checkpoints/<file stem>``, not the quick-start's;
- ``logging.metrics_file`` that is a directory, ``logging.tensorboard_dir`` that is a file: one line
  at validation (issue 26 item 13);
- ``data.train_files=PATH`` without brackets is the list ``[PATH]`` (issue 26 item 16);
- an override whose value YAML cannot parse, or that has no key (``=3``): one line naming it
  (issue 48 items 12 and 18).
"""

from __future__ import annotations

import pytest

from bebop_megatron.config import ConfigError, load_config
from tests.helpers.cli_batch import run_batch

BAD_FILES = {
    "list": (b"- train\n- model\n", "the top level is a list; it must be a mapping of sections"),
    "duplicate": (b"train:\n  steps: 3\n  lr: 0.1\n  steps: 4\n", "found duplicate key steps at line 4, column 3"),
    "syntax": (b"train: {steps: 3\nmodel: 1\n", "invalid YAML at line 2, column 6: did not find expected ',' or '}'"),
    "binary": (b"\x00\x01\x02train: 1\n", "not a text YAML file (control character 0x00 at position 0)"),
    "not-utf8": (bytes(range(128, 256)), "is not UTF-8 text (byte 0)"),
    "bool-in-string-field": (b"train:\n  resume: yes\n",
                             "config field 'train.resume' is a string, but YAML reads the unquoted word as the "
                             "boolean true (yes/no/on/off/true/false); quote it"),
}


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and excinfo.value.__cause__ is None
    return message


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_yaml_file_is_one_line_naming_it(tmp_path, case):
    content, expected = BAD_FILES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as excinfo:
        load_config(str(path))
    message = one_line(excinfo)
    assert message.startswith(f"config file {path}") and expected in message, message


def test_a_directory_as_config_file(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        load_config(str(tmp_path))
    assert one_line(excinfo) == f"config file {tmp_path} is a directory; give a YAML file (see examples/configs/)"


CLI_CASES = ["list", "duplicate", "binary", "directory"]
# (issue 48 items 12 and 18) Overrides that are not YAML or have no key: yaml's 30-line ParserError,
# and "unknown config key '?'".
BAD_OVERRIDES = {
    "data.train_files=[unclosed": "override 'data.train_files=[unclosed': its value is not valid YAML (did not find "
                                  "expected ',' or ']'); a list is written [a, b], and a value holding YAML's "
                                  "[ ] { } : # or a quote is quoted, e.g. key='a: b'",
    "train.steps={a": "override 'train.steps={a': its value is not valid YAML (did not find expected ',' or '}')",
    'train.lr="0.1': "override 'train.lr=\"0.1': its value is not valid YAML (found unexpected end of stream)",
    "=3": "override '=3' has no key before '=': write key=value, e.g. train.steps=100",
    " =3": "override ' =3' has no key before '='",
    "train.=3": "override 'train.=3': the key 'train.' has an empty part between its dots; write the dotted field "
                "name, e.g. train.steps=100",
    ".steps=3": "override '.steps=3': the key '.steps' has an empty part between its dots",
}
CLI_OVERRIDES = ["data.train_files=[unclosed", "=3"]


@pytest.mark.parametrize("override", list(BAD_OVERRIDES))
def test_a_bad_override_is_one_line_naming_it(override):
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["train.steps=5", override])
    message = one_line(excinfo)
    assert message.startswith(BAD_OVERRIDES[override]), message


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """``examples/pretrain_mtp.py --config FILE`` for each case, and with each of CLI_OVERRIDES, in
    one process (cli_batch)."""
    d = tmp_path_factory.mktemp("cli")
    paths = {}
    for case in CLI_CASES:
        paths[case] = d if case == "directory" else d / f"{case}.yaml"
        if case != "directory":
            paths[case].write_bytes(BAD_FILES[case][0])
    results = run_batch([{"tool": "examples/pretrain_mtp.py", "argv": ["--config", str(paths[case])]}
                         for case in CLI_CASES]
                        + [{"tool": "examples/pretrain_mtp.py", "argv": [override]} for override in CLI_OVERRIDES],
                        tmp_path_factory.mktemp("batch"))
    return {case: (f"config file {paths[case]}", proc) for case, proc in zip(CLI_CASES, results)} | {
        override: (BAD_OVERRIDES[override], proc) for override, proc in zip(CLI_OVERRIDES, results[len(CLI_CASES):])}


@pytest.mark.parametrize("case", CLI_CASES + CLI_OVERRIDES)
def test_the_cli_prints_one_error_line_and_exits_2(cli_runs, case):
    start, proc = cli_runs[case]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith(f"error: {start}"), proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]


SIZES = [
    ("model.kv_channels=0", "model.kv_channels=0 must be >= 1 (or null)"),
    ("model.kv_channels=-8", "model.kv_channels=-8 must be >= 1 (or null)"),
    ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by=0 must be >= 1"),
    ("model.max_position_embeddings=-1", "model.max_position_embeddings=-1 must be >= 1"),
    ("model.moe_ffn_hidden_size=0", "model.moe_ffn_hidden_size=0 must be >= 1 (or null)"),
    ("model.moe_shared_expert_intermediate_size=-1",
     "model.moe_shared_expert_intermediate_size=-1 must be >= 1 (or null)"),
    ("model.moe_router_num_groups=0", "model.moe_router_num_groups=0 must be >= 1 (or null)"),
    ("model.num_experts=-2", "model.num_experts=-2 must be >= 0"),
    ("model.moe_first_dense_layers=-1", "model.moe_first_dense_layers=-1 must be >= 0"),
    ("model.norm_epsilon=0", "model.norm_epsilon=0.0 must be > 0"),
    ("model.rotary_base=-1", "model.rotary_base=-1.0 must be > 0"),
    ("model.init_method_std=-0.1", "model.init_method_std=-0.1 must be >= 0"),
    ("model.yarn_original_max_position_embeddings=0", "model.yarn_original_max_position_embeddings=0 must be >= 1"),
    ("parallel.expert_tensor=0", "parallel.expert_tensor=0 must be >= 1 (or null)"),
    ("train.adam_beta2=1.5", "train.adam_beta2=1.5 must be < 1"),
    ("train.adam_eps=0", "train.adam_eps=0.0 must be > 0"),
    ("train.weight_decay=-1", "train.weight_decay=-1.0 must be >= 0"),
    ("train.lr=nan", "train.lr=nan must be a finite number"),
    ("data.markov_branching=0", "data.markov_branching=0 must be >= 1"),
    *[(f"loss.{name}={value}", f"loss.{name}={float(value)!r} must be in [0.001, 1000] (the logits are divided by "
       "it; beyond that range the softmax overflows)")
      for name in ("target_temperature", "draft_temperature") for value in ("1e-45", "0", "-1", "1e4", "nan")],
]


@pytest.mark.parametrize("override, message", SIZES, ids=[s[0] for s in SIZES])
def test_every_size_field_is_validated(override, message):
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, [override])
    assert one_line(excinfo) == message


def test_temperatures_at_the_ends_of_the_range_are_accepted():
    cfg = load_config(None, ["loss.target_temperature=0.001", "loss.draft_temperature=1000"])
    assert (cfg.loss.target_temperature, cfg.loss.draft_temperature) == (0.001, 1000.0)


def test_booleans_given_to_string_fields_are_reported_as_typed():
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, ["train.resume=yes"])
    assert one_line(excinfo) == "train.resume='yes' must be one of auto, none"
    assert load_config(None, ["save.dir=on"]).save.dir == "on"  # a directory called "on"
    assert load_config(None, ["model.qk_layernorm=yes"]).model.qk_layernorm is True  # real booleans still parse


def test_a_config_file_without_save_dir_gets_its_own(tmp_path):
    from bebop_megatron.cli import parse_config

    path = tmp_path / "my_run.yaml"
    path.write_text("train:\n  steps: 3\n")
    assert load_config(str(path)).save.dir == "checkpoints/my_run"
    # the entry point's embedded quick-start default (checkpoints/tiny) does not apply to a config file
    assert parse_config(["--config", str(path)], "x", defaults={"save": {"dir": "checkpoints/tiny"}}).save.dir \
        == "checkpoints/my_run"
    assert load_config(str(path), ["save.dir=elsewhere"]).save.dir == "elsewhere"
    path.write_text("save:\n  dir: null\n")
    assert load_config(str(path)).save.dir is None  # set in the file, even to null
    assert load_config(None).save.dir == "checkpoints/tiny"  # no file: the schema default


def test_logging_paths_of_the_wrong_kind_are_one_line_at_validation(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = {
        f"logging.metrics_file={tmp_path}":
            f"logging.metrics_file={tmp_path} is a directory; give a file path (the JSON lines are appended to it)",
        f"logging.tensorboard_dir={a_file}":
            f"logging.tensorboard_dir={a_file} is a file; give a directory (it is created if missing)",
        f"logging.metrics_file={a_file}/sub/metrics.jsonl":
            f"logging.metrics_file={a_file}/sub/metrics.jsonl: {a_file} is a file, not a directory",
        f"logging.wandb.dir={a_file}/wandb": f"logging.wandb.dir={a_file}/wandb: {a_file} is a file, not a directory",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as excinfo:
            load_config(None, [override])
        assert one_line(excinfo) == message
    ok = load_config(None, [f"logging.metrics_file={a_file}", f"logging.tensorboard_dir={tmp_path}/new/tb"])
    assert ok.logging.metrics_file == str(a_file)  # an existing file is appended to; a new directory is created


def test_a_single_source_may_be_given_without_brackets(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    assert load_config(None, [f"data.train_files={data}"]).data.train_files == [str(data)]
    assert load_config(None, [f"data.valid_files={{path: {data}, weight: 2}}"]).data.valid_files == \
        [{"path": str(data), "weight": 2}]
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  train_files: {data}\n")
    assert load_config(str(config)).data.train_files == [str(data)]
    with pytest.raises(ConfigError) as excinfo:  # any other scalar: what to write, not "AnyNode is not a ListConfig"
        load_config(None, ["data.train_files=3"])
    assert one_line(excinfo) == "config field 'data.train_files' is a list: write [3]"
