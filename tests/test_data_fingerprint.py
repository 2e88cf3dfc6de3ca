"""A training data file rewritten under the same name is noticed on resume (issue 26 item 6).

Checkpoints record a fingerprint of every file ``data.train_files`` reads
(``bebop_megatron/training/fingerprint.py``, ``common["train_data"]``); a resume whose JSONL
file or indexed dataset (``tools/preprocess_data.py --overwrite``) changed is one line naming
the file, before anything is built. One tiny 1-step run on a JSONL file and an indexed dataset.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.data import write_jsonl
from tests.helpers.launch import REPO, run_script


def docs(word: str, n: int = 12) -> list[dict]:
    return [{"prompt": f"say {word} {i} times", "response": " ".join([word] * (i + 3))} for i in range(n)]


def test_file_fingerprint_covers_every_byte(tmp_path):
    from bebop_megatron.training.fingerprint import data_record, file_fingerprint, sampled_file_fingerprint
    from bebop_megatron.training.resume import _sampled_match

    small = tmp_path / "small.jsonl"
    small.write_bytes(b'{"text": "a"}\n' * 10)
    before = file_fingerprint(str(small))
    small.write_bytes(b'{"text": "b"}\n' * 10)  # the same size, other bytes
    assert file_fingerprint(str(small)) != before
    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"text": "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwx"}\n' * 17_000)  # 1.1 MB
    shutil.copy(big, tmp_path / "copy.jsonl")
    assert file_fingerprint(str(big)) == file_fingerprint(str(tmp_path / "copy.jsonl"))
    legacy = sampled_file_fingerprint(str(big))
    with open(big, "r+b") as f:  # a same-size edit between the blocks the old fingerprint sampled
        f.seek(68 << 10)
        f.write(b"ZZZZ")
    assert sampled_file_fingerprint(str(big)) == legacy  # what let the edit through before
    assert file_fingerprint(str(big)) != file_fingerprint(str(tmp_path / "copy.jsonl"))
    # A checkpoint saved before records the sampled value: still accepted, as it can tell no more.
    assert _sampled_match(str(big), legacy) and not _sampled_match(str(big), file_fingerprint(str(tmp_path / "copy.jsonl")))
    assert data_record(None) == {}


def train_one_step(root):
    """A 1-step run on a JSONL file and an indexed dataset; returns its config file."""
    from bebop_megatron.data.preprocess import preprocess

    jsonl = write_jsonl(root / "chat.jsonl", docs("cat"))
    preprocess([str(write_jsonl(root / "src.jsonl", docs("dog")))], str(root / "ds" / "train"), progress=False,
               log=lambda _: None)
    config = root / "run.yaml"
    config.write_text(f"""device: cpu
model: {{num_layers: 2, hidden_size: 64, ffn_hidden_size: 128}}
parallel: {{tensor: 1}}
data: {{train_files: [{jsonl}, {root / 'ds' / 'train'}]}}
train: {{steps: 1, micro_batch_size: 2, global_batch_size: 2, seq_length: 32}}
save: {{dir: {root / 'run'}}}
""")
    run_script(str(REPO / "examples" / "pretrain_mtp.py"), ["--config", str(config)], nproc=1)
    return config


def test_resume_refuses_a_training_data_file_rewritten_under_the_same_name(tmp_path):
    from bebop_megatron.config import load_config
    from bebop_megatron.data.preprocess import preprocess
    from bebop_megatron.training.resume import StartError, common_state, plan_start

    config = train_one_step(tmp_path)
    ckpt, jsonl, prefix = tmp_path / "run" / "iter_0000001", tmp_path / "chat.jsonl", tmp_path / "ds" / "train"
    cfg = load_config(str(config), ["train.steps=2"])

    def refusal() -> str:
        with pytest.raises(StartError) as err:
            plan_start(cfg)
        (tmp_path / "run" / "run.lock").unlink()
        assert "\n" not in str(err.value)
        return str(err.value)

    assert plan_start(cfg).resume_path == str(ckpt)  # unchanged: resumes
    (tmp_path / "run" / "run.lock").unlink()
    original = jsonl.read_bytes()
    write_jsonl(jsonl, docs("cow"))  # a regenerated JSONL file
    assert refusal().startswith(f"cannot resume from {ckpt}: the training data file {jsonl} changed since the "
                                "checkpoint was trained on it (fingerprint ")
    jsonl.write_bytes(original)
    preprocess([str(write_jsonl(tmp_path / "other.jsonl", docs("owl")))], str(prefix), progress=False,
               log=lambda _: None, overwrite=True)
    message = refusal()
    assert message.startswith(f"cannot resume from {ckpt}: the training data file {prefix}.bin changed"), message
    assert message.endswith("restore it, or start a new run in another save.dir (or train.resume=none "
                            "save.overwrite=true)")
    saved = common_state(str(ckpt))["train_data"]
    assert list(saved) == [str(jsonl)] + [f"{prefix}{suffix}" for suffix in (
        ".bin", ".idx", "_lossmask.bin", "_lossmask.idx", "_meta.json")] and all(saved.values())
