"""What a run starts from (bebop_megatron/training/resume.py, lock.py): decided before any model
is built, on real checkpoints of a 2-step run (one CPU rank, a checkpoint after each step).

- ``latest`` missing, empty or dangling next to complete ``iter_N``: the newest complete one,
  said in one line (partial ``.tmp`` and metadata-less directories are not complete);
- a changed model, backbone or data definition is refused with every changed field listed;
  steps, logging and the LR schedule may change (one line; the new LR from the resumed step);
- ``train.resume=none`` into a directory with checkpoints: refused, or ``save.overwrite=true``;
- a damaged checkpoint (truncated shard, ``.metadata`` or ``metadata.json``) is named, with the
  newest intact one before it;
- the ``save.dir`` lock: a live run refuses a second one, a dead one's lock is taken over;
- end to end: the refused resume is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from bebop_megatron.config import load_config
from tests.helpers import forkserver
from tests.helpers.launch import REPO
from tests.helpers.production import output, run_ranks

TINY = [
    "device=cpu", "parallel.tensor=1", "train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_length=32",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.steps=2", "save.interval=1",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume_plan")
    codes = run_ranks(tmp / "run.jsonl", [*TINY, f"save.dir={tmp / 'ckpt'}"], nproc=1)
    assert codes == [0], output(tmp / "run.jsonl", 0)[1][-3000:]
    assert not (tmp / "ckpt" / "run.lock").exists()  # released at exit
    return tmp / "ckpt"


@pytest.fixture
def ckpt(trained, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(trained, copy)
    return copy


def plan(ckpt, *overrides):
    from bebop_megatron.training.resume import plan_start

    return plan_start(load_config(None, [*TINY, f"save.dir={ckpt}", *overrides]))


def refusal(ckpt, *overrides) -> str:
    from bebop_megatron.training.resume import StartError

    with pytest.raises(StartError) as err:
        plan(ckpt, *overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_an_intact_latest_is_followed(ckpt):
    start = plan(ckpt)
    assert start.resume_path == str(ckpt / "iter_0000002") and start.notices == []


@pytest.mark.parametrize("latest", [None, "", "iter_0000009", "iter_0000003"],
                         ids=["missing", "empty", "gone", "partial"])
def test_a_missing_or_dangling_latest_resumes_from_the_newest_complete_checkpoint(ckpt, latest):
    (ckpt / "iter_0000003.tmp").mkdir()  # a save that never completed
    (ckpt / "iter_0000003").mkdir()  # a directory without its metadata is not complete either
    (ckpt / "iter_0000003" / "__0_0.distcp").write_bytes(b"half")
    if latest is None:
        (ckpt / "latest").unlink()
    else:
        (ckpt / "latest").write_text(latest)
    start = plan(ckpt)
    assert start.resume_path == str(ckpt / "iter_0000002")
    assert len(start.notices) == 1
    assert start.notices[0].startswith(f"{ckpt / 'latest'} ")
    assert start.notices[0].endswith(f": resuming from the newest complete checkpoint {ckpt / 'iter_0000002'}")


@pytest.mark.parametrize("overrides, changed", [
    (["model.num_layers=3"], ["model.num_layers 2 -> 3"]),
    (["model.hidden_size=128", "model.ffn_hidden_size=256", "mtp.num_steps=2"],
     ["model.ffn_hidden_size 128 -> 256", "model.hidden_size 64 -> 128", "mtp.num_steps 3 -> 2"]),
    (["model.backbone_checkpoint=/elsewhere/backbone"], ["model.backbone_checkpoint null -> '/elsewhere/backbone'"]),
    (["train.seed=7"], ["train.seed 1234 -> 7"]),  # the random backbone's initialisation
    (["data.seed=7", "train.seq_length=16"], ["data.seed 1234 -> 7", "train.seq_length 32 -> 16"]),
    (["precision=bf16"], ["precision 'fp32' -> 'bf16'"]),  # another optimizer state
    (["parallel.distributed_optimizer=true"], ["parallel.distributed_optimizer False -> True"]),  # its format
], ids=["num_layers", "sizes", "backbone", "backbone-seed", "data", "precision", "distributed-optimizer"])
def test_a_changed_model_or_data_definition_is_refused_listing_the_fields(ckpt, overrides, changed):
    message = refusal(ckpt, *overrides, "train.steps=4")
    assert message.startswith(f"cannot resume from {ckpt / 'iter_0000002'}: changed {', '.join(changed)}; ")
    assert "train.steps" not in message  # allowed changes are not part of the refusal


def test_steps_logging_and_the_lr_schedule_may_change(ckpt):
    start = plan(ckpt, "train.steps=6", "train.lr=2e-3", "train.lr_schedule=cosine", "train.log_interval=2",
                 "save.keep_last=1", "eval.interval=3")
    assert start.resume_path == str(ckpt / "iter_0000002")
    assert start.notices == [
        f"resuming from {ckpt / 'iter_0000002'} with changed settings: eval.interval 0 -> 3, save.keep_last 0 -> 1, "
        "train.log_interval 1 -> 2, train.lr 0.001 -> 0.002, train.lr_schedule 'constant' -> 'cosine', "
        "train.steps 2 -> 6 (the LR schedule is rebuilt from the new values and applies from step 3)"
    ]


def test_resume_none_into_a_directory_with_checkpoints_needs_overwrite(ckpt):
    message = refusal(ckpt, "train.resume=none")
    assert message.startswith(f"save.dir={ckpt} already holds checkpoints (")
    assert "save.overwrite=true" in message
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000001", "iter_0000002", "latest", "run.lock"]
    start = plan(ckpt, "train.resume=none", "save.overwrite=true")
    assert start.resume_path is None and "deleted 3 checkpoint entries" in start.notices[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["run.lock"]
    with pytest.raises(ValueError, match="save.overwrite=true deletes the checkpoints in save.dir: it needs "
                                         "train.resume=none"):
        load_config(None, ["save.overwrite=true"])


@pytest.mark.parametrize("damage, problem", [
    ("shard", "__0_0.distcp is truncated ("),
    ("torch-metadata", ".metadata is unreadable or truncated ("),
    ("megatron-metadata", "metadata.json is unreadable or truncated ("),
])
def test_a_damaged_checkpoint_is_named_with_the_newest_intact_one(ckpt, damage, problem):
    newest = ckpt / "iter_0000002"
    name = {"shard": "__0_0.distcp", "torch-metadata": ".metadata", "megatron-metadata": "metadata.json"}[damage]
    data = (newest / name).read_bytes()
    (newest / name).write_bytes(data[: len(data) // 2])
    message = refusal(ckpt)
    assert message.startswith(f"checkpoint {newest} is damaged: {problem}")
    assert f"the newest intact checkpoint before it is {ckpt / 'iter_0000001'}: move {newest} aside" in message
    shutil.move(newest, str(newest) + ".damaged")  # what the message says to do
    start = plan(ckpt)
    assert start.resume_path == str(ckpt / "iter_0000001") and "resuming from the newest complete" in start.notices[0]


def _write_lock(ckpt, **holder):
    from bebop_megatron.training.lock import this_run

    (ckpt / "run.lock").write_text(json.dumps({**this_run(), **holder}))


def test_a_live_run_holding_the_lock_refuses_a_second_one(ckpt):
    from bebop_megatron.training import lock

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(ckpt, pid=other.pid, process_start=lock._process_start_time(other.pid))
        message = refusal(ckpt)
        assert message.startswith(f"save.dir={ckpt} is in use by another run (pid {other.pid} on "
                                  f"{socket.gethostname()}, started ")
        assert f"lock {ckpt / 'run.lock'}" in message
        _write_lock(ckpt, host="another-node", pid=1)  # cannot be checked from here: refused too
        assert "is in use by another run (pid 1 on another-node" in refusal(ckpt)
    finally:
        other.kill()
        other.wait()


def test_a_stale_lock_is_taken_over_with_a_notice(ckpt, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(ckpt, pid=gone.pid)
    start = plan(ckpt)
    assert start.notices == [f"save.dir={ckpt}: taking over the lock of a run that is gone (pid {gone.pid} on "
                              f"{socket.gethostname()}, started " + start.notices[0].split(", started ")[1]]
    assert json.loads((ckpt / "run.lock").read_text())["pid"] == os.getpid()
    # a requeued Slurm job (same job, later restart) takes over its earlier incarnation's lock
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _write_lock(ckpt, host="another-node", pid=1, slurm_job="42", slurm_restart=0)
    assert "taking over the lock of a run that is gone (pid 1 on another-node, Slurm job 42" in plan(ckpt).notices[0]


def test_a_refused_resume_is_one_line_before_anything_is_built(ckpt):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    # The quick start's embedded default fits a synthetic backbone: back to the schema's defaults.
    schema = ["model.backbone_init=random", "data.markov_branching=4", "data.markov_min_branching=null"]
    proc = forkserver.run([sys.executable, "examples/pretrain_mtp.py", *TINY, *schema, f"save.dir={ckpt}",
                           "model.num_layers=3", "train.steps=4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "step " not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot resume from {ckpt / 'iter_0000002'}: changed model.num_layers 2 -> 3; the "
                      "checkpoint was trained with the saved values (they define the model, its backbone, the data "
                      "or the optimizer state): restore them, or start a new run in another save.dir (or "
                      "train.resume=none save.overwrite=true)"], proc.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000001", "iter_0000002", "latest"]  # lock released


def _docs_resume_fields() -> tuple[set, set]:
    """Backticked names of the "Changed config on resume" item in docs/production.md (moved there
    from the README): (named, excepted)."""
    import re

    text = (REPO / "docs" / "production.md").read_text()
    item = text[text.index("- **Changed config on resume**"):]
    item = item[:item.index("\n- **", 1)]
    refused_part = item[:item.index("Everything else may change")]
    excepted = set(re.findall(r"`([^`]+)`", re.search(r"\(not ([^)]*)\)", refused_part).group(1)))
    return set(re.findall(r"`([^`]+)`", refused_part)) - excepted, excepted


def test_docs_name_every_field_a_resume_refuses():
    """Every config field whose change ``compare_configs`` can refuse is named in docs/production.md
    (``model.*`` / ``mtp.*`` cover their sections), and the exceptions it names are the code's."""
    from omegaconf import OmegaConf

    from bebop_megatron.config import Config
    from bebop_megatron.training import resume

    cfg = load_config(overrides=["model.backbone_init=random"])  # train.seed counts with a random backbone
    fields = resume._flatten(OmegaConf.to_container(OmegaConf.structured(Config())))
    refused = {key for key in fields if resume._refused(key, object(), object(), cfg)}
    named, excepted = _docs_resume_fields()
    missing = {key for key in refused if key not in named and f"{key.split('.')[0]}.*" not in named}
    assert not missing, f"docs/production.md's resume item does not name {sorted(missing)}"
    assert excepted == set(resume.ALLOWED_MODEL_KEYS)
    assert not any(resume._refused(key, object(), object(), cfg) for key in excepted)


@pytest.mark.parametrize("resume", ["auto", "none"])
def test_a_latest_that_is_a_directory_is_refused_up_front(tmp_path, resume):
    """(issue 26 item 20) It used to read as 'latest is missing', train, then fail on latest.tmp."""
    (tmp_path / "ckpt" / "latest").mkdir(parents=True)
    message = refusal(tmp_path / "ckpt", f"train.resume={resume}")
    if resume == "auto":
        latest = tmp_path / "ckpt" / "latest"
        assert message == (f"{latest} is a directory; it must be the file naming the newest checkpoint: move it aside "
                           f"(e.g. mv {latest} {latest}.old) and run again")
    else:  # train.resume=none: refused unless save.overwrite=true, which deletes it
        assert "already holds checkpoints (latest)" in message


def test_a_training_checkpoint_is_refused_as_the_backbone(trained):
    """(issue 26 item 14) A real checkpoint of this trainer holds no backbone weights (it failed with
    a KeyError after the model build); tests/test_checkpoint_kinds.py has the other kinds."""
    from bebop_megatron.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, [*TINY, f"model.backbone_checkpoint={trained / 'iter_0000002'}"])
    assert str(err.value).startswith(f"model.backbone_checkpoint={trained / 'iter_0000002'} is a training checkpoint: "
                                     "it holds MTP heads and optimizer state, not the backbone's weights (it was "
                                     "trained on a randomly initialised backbone); pass the backbone"), str(err.value)
    with pytest.raises(ConfigError, match=r"is a training run's save.dir"):
        load_config(None, [*TINY, f"model.init_checkpoint={trained}"])
