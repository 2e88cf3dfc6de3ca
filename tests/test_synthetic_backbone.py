"""The quick start's fitted synthetic backbone (``bebop_megatron/training/synthetic_backbone.py``)
and its language (``MarkovDataset`` with state-dependent branching).

- the language: ``entropy_rate`` equals a Monte Carlo estimate of -log P(x_{t+1} | x_t) on
  its own samples; the quick-start language's per-token entropy spans near 0 to > 2 nats;
  held-out samples continue the training ones;
- the fit: deterministic (a second fit into another cache gives the same losses and the same
  files) and its loss ends far below ln V, near the exact entropy rate;
- the cache: reused when complete, rebuilt when missing, keyed by what defines the weights
  (not by the MTP training settings);
- end to end: a run on the fitted backbone and ``tools/eval_acceptance.py --data synthetic``
  show p with several entropy bins, and the speed-up recommendation equals the formula.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from bebop_megatron.data.synthetic import MarkovDataset
from bebop_megatron.training import synthetic_backbone
from tests.helpers.cli_batch import run_batch
from tests.helpers.launch import REPO
from tests.helpers.synthetic_fit import TINY_FIT, tiny_config


def test_entropy_rate_equals_monte_carlo():
    ds = MarkovDataset(4000, 32, 64, 16, seed=7, min_branching=2)
    P = ds.transition_matrix()
    assert np.allclose(P.sum(1), 1.0) and (P > 0).sum(1).min() >= 2
    nll = np.array([-np.log(P[s[:-1], s[1:]]).mean() for s in (ds[i] for i in range(len(ds)))])
    stderr = nll.std() / math.sqrt(len(nll))
    assert abs(nll.mean() - ds.entropy_rate()) < 4 * stderr, (nll.mean(), ds.entropy_rate(), stderr)


def test_quick_start_language_entropy_varies_by_token():
    ds = MarkovDataset(4096, 64, 512, 32, seed=1234, min_branching=2)
    P = ds.transition_matrix()
    H = -np.where(P > 0, P * np.log(np.where(P > 0, P, 1.0)), 0.0).sum(1)
    assert np.percentile(H, 10) < 0.5 and np.percentile(H, 90) > 2.0
    assert 1.0 < ds.entropy_rate() < 2.0 < math.log(512)


def test_held_out_samples_follow_the_training_ones():
    train = MarkovDataset(100, 16, 64, 8, seed=3, min_branching=2)
    held_out = MarkovDataset(5, 16, 64, 8, seed=3, min_branching=2, index_offset=100)
    far = MarkovDataset(200, 16, 64, 8, seed=3, min_branching=2)
    for i in range(5):
        assert np.array_equal(held_out[i], far[100 + i])
        assert not np.array_equal(held_out[i], train[i])


def test_fit_is_deterministic_and_reaches_the_entropy_rate(synthetic_cache, tmp_path, monkeypatch):
    _, path = synthetic_cache
    first = json.loads(open(os.path.join(path, synthetic_backbone.DONE)).read())
    assert first["first_loss"] > 0.9 * first["ln_vocab"]
    assert first["final_loss"] < 0.5 * first["ln_vocab"], first["final_loss"]
    assert first["final_loss"] < first["entropy_rate"] + 0.5, (first["final_loss"], first["entropy_rate"])
    monkeypatch.setenv("BEBOP_MEGATRON_CACHE", str(tmp_path))
    cfg = tiny_config()
    other = synthetic_backbone.resolve(cfg)
    assert other == os.path.join(str(tmp_path), "synthetic_backbone", os.path.basename(path))
    again = synthetic_backbone.run_fit(cfg, other, log=lambda line: None)
    assert again["losses"] == first["losses"]
    for name in sorted(os.listdir(path)):
        if name.endswith(".distcp"):
            with open(os.path.join(path, name), "rb") as a, open(os.path.join(other, name), "rb") as b:
                assert a.read() == b.read(), name


def test_cache_is_reused_rebuilt_and_keyed(synthetic_cache, monkeypatch):
    cache, path = synthetic_cache
    monkeypatch.setenv("BEBOP_MEGATRON_CACHE", str(cache))
    fits = []
    monkeypatch.setattr(synthetic_backbone, "run_fit", lambda cfg, p, log=print: fits.append(p))
    lines = []
    cfg = tiny_config("train.steps=7", "train.lr=1e-2", "mtp.num_steps=2", "loss.type=ce", "train.seed=5")
    assert synthetic_backbone.prepare(cfg, log=lines.append) == path  # MTP training settings: the same backbone
    assert cfg.model.backbone_checkpoint == path and not fits and "cached in" in lines[0]
    # A config already resolved to the entry (a saved run's) still applies.
    assert synthetic_backbone.prepare(cfg, log=lines.append) == path and not fits
    for change in ("model.hidden_size=32", "data.markov_branching=8", "data.seed=1", "train.seq_length=16"):
        changed = tiny_config(change)
        assert synthetic_backbone.prepare(changed, log=lines.append) not in (None, path)
    assert len(set(fits)) == 4 and path not in fits
    # The padded vocabulary is part of the entry and recorded in the run's config.
    assert cfg.model.padded_vocab_size == 128
    at_tp2 = tiny_config("parallel.tensor=2")
    assert synthetic_backbone.prepare(at_tp2, log=lines.append) not in (None, path)
    assert at_tp2.model.padded_vocab_size == 256
    assert synthetic_backbone.prepare(tiny_config("model.backbone_init=random")) is None
    jsonl = REPO / "examples" / "data" / "tiny_train.jsonl"
    assert synthetic_backbone.prepare(tiny_config(f"data.train_files=[{jsonl}]")) is None


def test_missing_entry_is_rebuilt(synthetic_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("BEBOP_MEGATRON_CACHE", str(tmp_path))
    fits = []
    monkeypatch.setattr(synthetic_backbone, "run_fit", lambda cfg, p, log=print: fits.append(p))
    cfg = tiny_config()
    synthetic_backbone.prepare(cfg, log=lambda line: None)
    assert fits == [synthetic_backbone.cache_path(cfg)]


def test_run_and_report_on_the_fitted_backbone(synthetic_cache, tmp_path):
    cache, path = synthetic_cache
    save, out = tmp_path / "run", tmp_path / "report"
    # Training, then the report, in one process as their __main__ runs them (tests/helpers/cli_batch.py).
    proc, report_proc = run_batch([
        {"tool": "examples/pretrain_mtp.py", "argv": ["parallel.tensor=1", *TINY_FIT, "train.steps=4", "train.lr=3e-3",
                                                     f"save.dir={save}"]},
        {"tool": "eval_acceptance", "argv": ["--checkpoint", str(save), "--data", "synthetic",
                                             "--synthetic-samples", "24", "--temperatures", "0.7", "1.0",
                                             "--sim-positions", "0", "--cost-target-ms", "20", "--cost-draft-ms", "3",
                                             "--cost-overhead-ms", "1", "--out-dir", str(out), "--no-progress"]},
    ], tmp_path / "batch", env={"BEBOP_MEGATRON_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"backbone: fitted to the synthetic language, cached in {path}" in proc.stdout
    assert report_proc.returncode == 0, report_proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["num_rows"] == 24
    entry = report["per_temperature"]["1"]
    # p has the language's structure: mean entropy far below ln V, positions in several bins.
    assert entry["entropy_target"][0] < 0.6 * math.log(64)
    assert sum(c > 0 for c in entry["entropy_bins"]["count"]) >= 4
    speedup = report["speedup"]
    assert speedup["costs"]["source"] == "given"
    assert speedup["costs"]["draft_ratio"] == 3 / 20 and speedup["costs"]["overhead"] == 1 / 20
    for tau, row in speedup["per_temperature"].items():
        e = report["per_temperature"][tau]["accept_len_rs"]
        want = [(1 + e[g - 1]) / (1 + g * 3 / 20 + 1 / 20) for g in (1, 2, 3)]
        assert row["speedup_rs"] == pytest.approx(want, rel=1e-12)
        best = max(range(3), key=lambda i: want[i])
        assert row["best_gamma_rs"] == (best + 1 if want[best] > 1 else 0)
        assert f"T={tau}: speed-up RS by gamma" in report_proc.stdout
    assert "recommended gamma" in report_proc.stdout and (out / "speedup_vs_gamma.png").stat().st_size > 10_000
