"""``tools/objective_study.py`` and ``bebop_megatron.study``: the objective study.

- the response bootstrap (:mod:`bebop_megatron.study.intervals`) against a float64 reference that
  resamples responses explicitly (positions concatenated, statistics recomputed), on synthetic
  clustered data: one seed, several seeds, paired differences; the decode-exact column's interval
  equals :func:`bebop_megatron.chain.decode_exact.ratio_interval`'s; and the interval widens as the
  positions of one response become correlated, while the interval over positions does not;
- a dry run of the tool on a tiny random Llama (convert_from_hf of a transformers model saved
  in a temporary folder; its own answers to random prompts): every stage, two seeds, the fresh
  condition and the existing one (the fresh ce run's head continued), the report; then, the study killed inside a run, a re-run
  that skips what is finished and continues the killed run from its checkpoint;
- ``--ranks 2``: one of that dry run's runs again in 2 processes at tensor parallel 2 gives its
  held-out statistics (fp32 rounding apart); a ``--ranks`` the model cannot split is one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from bebop_megatron.study import intervals
from tests.helpers import forkserver
from tests.helpers.launch import REPO


def clustered(rng, num_texts: int, per_text: int, rho: float, K: int = 3):
    """Rows ``[K, N]`` whose alphas share a per-response effect: within-response correlation ``rho``."""
    text = np.repeat(np.arange(num_texts), per_text)
    effect = rng.normal(size=num_texts)[text]
    noise = rng.normal(size=(K, len(text)))
    z = np.sqrt(rho) * effect + np.sqrt(1 - rho) * noise
    alpha = 1 / (1 + np.exp(-(0.3 + 0.8 * z)))
    rows = {"chain": np.ones((K, len(text)), dtype=bool), "alpha_rs": alpha, "alpha_to": alpha ** 1.3,
            "entropy_target": rng.gamma(2.0, 1.0, size=(K, len(text)))}
    rows["chain"][2, ::7] = False  # some chains stop early
    return rows, text


def reference(rows_by_seed, texts, gamma, num_boot, seed, rows_b=None, name="alpha_rs_step1"):
    """Float64, explicit, responses only: per resample draw the responses, gather their positions
    and recompute the statistic from scratch per seed (every seed kept); mean over the seeds."""
    rng = np.random.default_rng(seed)
    n = texts.max() + 1
    members = [np.flatnonzero(texts == t) for t in range(n)]

    def stat(rows, picks):
        idx = np.concatenate([members[t] for t in picks])
        sub = {k: np.asarray(v)[:, idx] for k, v in rows.items()}
        return intervals.point_metrics(sub, gamma)[name]

    def value(s, picks):
        return stat(rows_by_seed[s], picks) - (stat(rows_b[s], picks) if rows_b is not None else 0.0)

    S = len(rows_by_seed)
    point = np.mean([value(s, np.arange(n)) for s in range(S)])
    samples = []
    for _ in range(num_boot):
        picks = rng.integers(0, n, n)
        samples.append(np.mean([value(s, picks) for s in range(S)]))
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return point, lo, hi


def test_response_bootstrap_against_float64_reference():
    rng = np.random.default_rng(7)
    G = 3
    rows, text = clustered(rng, 30, 12, 0.5)
    rows2, _ = clustered(rng, 30, 12, 0.5)
    n = text.max() + 1
    cols = [intervals.text_columns(r, text, n, G) for r in (rows, rows2)]
    for name in ("alpha_rs_step1", "alpha_rs_step3", f"accept_len_rs_g{G}", "entropy_slope_rs"):
        got = intervals.response_bootstrap(cols[:1], [name], num_boot=200, seed=3)[name]
        assert got == pytest.approx(reference([rows], text, G, 200, 3, name=name), rel=1e-9, abs=1e-12), name
    # two seeds (kept: responses only); and a paired difference (one draw of responses for both runs)
    got = intervals.response_bootstrap(cols, ["alpha_rs_step1"], num_boot=200, seed=4)["alpha_rs_step1"]
    assert got == pytest.approx(reference([rows, rows2], text, G, 200, 4), rel=1e-9)
    got = intervals.paired_bootstrap(cols[:1], cols[1:], ["accept_len_rs_g3"], num_boot=200, seed=5)
    assert got["accept_len_rs_g3"] == pytest.approx(
        reference([rows], text, G, 200, 5, rows_b=[rows2], name="accept_len_rs_g3"), rel=1e-9, abs=1e-12)
    # the decode-exact column: a pooled ratio over responses, as decode_exact.ratio_interval's
    from bebop_megatron.chain.decode_exact import ratio_interval

    acc, ver = rng.uniform(0, 3, n), rng.uniform(0.5, 2, n)
    c = intervals.text_columns(rows, text, n, G, {"rs": (acc, ver)})
    got = intervals.response_bootstrap([c], ["accept_len_decode_rs_g3"], num_boot=300, seed=2)["accept_len_decode_rs_g3"]
    ratio, (lo, hi) = ratio_interval(acc, ver, num_boot=300, seed=2)
    assert got == pytest.approx((ratio, lo, hi), rel=1e-12)


def test_response_interval_widens_with_correlation_within_responses():
    G = 3
    widths = {}
    for rho in (0.0, 0.3, 0.8):
        rows, text = clustered(np.random.default_rng(11), 60, 40, rho)
        cols = intervals.text_columns(rows, text, 60, G)
        _, lo, hi = intervals.response_bootstrap([cols], ["alpha_rs_step1"], num_boot=400)["alpha_rs_step1"]
        _, plo, phi = intervals.position_bootstrap(rows, G, num_boot=400)["alpha_rs_step1"]
        widths[rho] = (hi - lo, phi - plo)
    (r0, p0), (r3, p3), (r8, p8) = widths[0.0], widths[0.3], widths[0.8]
    assert r0 == pytest.approx(p0, rel=0.3)  # independent positions: responses and positions agree
    assert r0 < r3 < r8 and r8 > 3 * p8  # correlated: only the interval over responses widens
    assert max(p0, p3, p8) < 1.5 * min(p0, p3, p8)


# ----------------------------------------------------------------------------- the tool, end to end


def _tiny_model(tmp_path):
    spec = importlib.util.spec_from_file_location("tiny_model_for_study", REPO / "benchmarks" / "gpu" / "tiny_model.py")
    files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files)
    return files.make_tiny_model(tmp_path / "hf"), files.make_tiny_prompts(tmp_path / "prompts", 16, 5)


STUDY = ["--max-new-tokens", "24", "--gen-batch-size", "8", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--tokens", "768", "--curve-points", "2", "--curve-rows", "64",
         "--eval-chunk-positions", "64", "--loss-chunk-tokens", "512", "--num-boot", "50", "--objectives", "ce,e2e_tv",
         "--seeds", "0,1", "--conditions", "fresh,existing", "--existing", "ce:768"]


def _command(tmp_path):
    return [sys.executable, str(REPO / "tools" / "objective_study.py"), "--hf-dir", str(tmp_path / "hf"), "--prompts",
            str(tmp_path / "prompts"), "--work", str(tmp_path / "work"), *STUDY]


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    return env


def _study_killed_in_a_run(tmp_path):
    """The study, killed (SIGKILL, its whole process group) as soon as a run after the first two
    has written a checkpoint and not yet its record: that run's folder."""
    import signal
    import subprocess
    import time

    runs = tmp_path / "work" / "runs"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(_command(tmp_path), cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                finished = len(list(runs.rglob("record.json"))) if runs.is_dir() else 0
                found = [p.parent.parent for p in runs.glob("*/*/*/ckpt/latest*")
                         if not (p.parent.parent / "record.json").exists()] if finished >= 2 else []
                if found:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return found[0]
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    raise AssertionError("no run checkpointed before the study ended: " + (tmp_path / "killed.log").read_text()[-3000:])


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The study of :data:`STUDY` on a tiny random Llama, killed inside a run (after one of its
    checkpoints), then run again: ``(folder, the killed run's folder, {finished record: mtime}
    before the re-run, the re-run's CompletedProcess)``. Its import, responses and runs also serve
    the ``--ranks`` test (one study for the module: the file's tests share a worker)."""
    tmp_path = tmp_path_factory.mktemp("study")
    _tiny_model(tmp_path)
    killed = _study_killed_in_a_run(tmp_path)
    assert not (killed / "record.json").exists()
    done_before = {p: p.stat().st_mtime_ns for p in (tmp_path / "work" / "runs").rglob("record.json")}
    proc = forkserver.run(_command(tmp_path), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp_path, killed, done_before, proc


def test_study_dry_run_every_stage_and_resume(dry_run):
    # Killed inside a run (after one of its checkpoints), then run again: the finished runs and
    # stages are skipped, the killed run continues from its checkpoint, the rest run.
    tmp_path, killed, done_before, proc = dry_run
    assert f"{len(done_before)} finished, {8 - len(done_before)} to run" in proc.stdout
    assert f"{killed}: continuing a killed run" in proc.stdout
    assert "import:" not in proc.stdout and "responses (" not in proc.stdout
    assert all(p.stat().st_mtime_ns == t for p, t in done_before.items())
    work, out = tmp_path / "work", tmp_path / "work" / "report"
    runs = {}
    for cond in ("fresh", "existing"):
        for obj in ("ce", "e2e_tv"):
            for seed in (0, 1):
                runs[cond, obj, seed] = json.loads((work / "runs" / cond / obj / f"seed{seed}" / "record.json").read_text())
    for (cond, obj, seed), r in runs.items():
        assert r["steps"] == 3 and r["tokens"] == 768 and r["loss"] == obj
        end = r["curve"][-1]
        # The trainer's held-out pass (its loss's statistics, every held-out row at T=1) against the
        # study's rows of the same model (eval_acceptance's statistics): alpha and the decode-exact E[L].
        assert end["alpha_rs"][0] == pytest.approx(r["metrics"]["1"]["alpha_rs_step1"], abs=1e-5)
        rows = np.load(work / "runs" / cond / obj / f"seed{seed}" / "rows.npz")
        acc, ver = rows["1|decode_rs"].sum(0)
        assert end["accept_len_decode_rs"][2] == pytest.approx(acc / ver, rel=1e-4)
        # every position belongs to a held-out response, numbered as the decode-exact sums
        assert rows["1|text"].max() + 1 == len(rows["1|decode_rs"]) and len(rows["1|decode_rs"]) >= 4
        # T=0.7 is evaluated on the held-out prompts' answers sampled at 0.7, not on the T=1 text
        assert r["own_text_temperatures"] == ["0.7"] and rows["0.7|text"].max() + 1 == len(rows["0.7|decode_rs"])
        assert rows["0.7|chain"].shape[1] != rows["1|chain"].shape[1]
    # Per seed the same initialisation (the untrained head's curve point) for every objective, another per seed.
    for seed in (0, 1):
        assert runs["fresh", "ce", seed]["curve"][0] == runs["fresh", "e2e_tv", seed]["curve"][0]
        assert runs["existing", "ce", seed]["curve"][0] == runs["existing", "e2e_tv", seed]["curve"][0]
    assert runs["fresh", "ce", 0]["curve"][0] != runs["fresh", "ce", 1]["curve"][0]
    # the existing condition starts from the seed's ce head: with --existing ce:768 (the runs' tokens)
    # the fresh ce run's own head (its last held-out pass is the existing runs' first), not trained twice
    for seed in (0, 1):
        start, ce_end = runs["existing", "ce", seed]["curve"][0], runs["fresh", "ce", seed]["curve"][-1]
        assert start["alpha_rs"] == pytest.approx(ce_end["alpha_rs"], abs=1e-6)
        assert start["accept_len_decode_rs"] == pytest.approx(ce_end["accept_len_decode_rs"], abs=1e-6)
    assert not list(work.glob("heads/*.run"))
    # the held-out prompts answered at T=1 and at 0.7: the same ids, other texts, the temperature recorded
    responses = json.loads((work / "data" / "responses.json").read_text())
    assert responses["heldout"]["temperature"] == 1.0 and responses["heldout_t0p7"]["temperature"] == 0.7
    at = {split: [json.loads(line) for line in (work / "data" / f"{split}.jsonl").read_text().splitlines()]
          for split in ("heldout", "heldout_t0p7")}
    assert sorted(x["id"] for x in at["heldout"]) == sorted(x["id"] for x in at["heldout_t0p7"])
    answers = {split: [x["messages"][-1]["content"] for x in lines] for split, lines in at.items()}
    assert answers["heldout"] != answers["heldout_t0p7"]
    assert (work / "data" / "heldout_t0p7.bin").is_file()
    text = (out / "RESULTS.md").read_text()
    assert "## Condition `fresh`" in text and "## Condition `existing`" in text
    # the recommendation per temperature, at the top and in its section: T=0.7 on its own text (the
    # held-out prompts answered at 0.7), so its decode-exact number is exact too
    assert "paired difference against ce" in text and "E[L]\\(3) decode-exact" in text
    assert text.count("- fresh, T=1: ") == 2 and text.count("- fresh, T=0.7: ") == 2
    assert "no recommendation" not in text and "the same held-out prompts answered at each temperature" in text
    assert "(2 seeds, 768 tokens per run" in text and "Partial study" not in text
    csv_text = (out / "results.csv").read_text()
    assert "fresh,e2e_tv,ce,0.7,0.7,no,2,0/1,768," in csv_text and ",diff_accept_len_decode_rs_g3," in csv_text
    if importlib.util.find_spec("matplotlib"):
        assert (out / "curves_fresh.png").stat().st_size > 0 and (out / "curves_existing.png").stat().st_size > 0
    assert "NaN" not in (out / "summary.json").read_text() and "NaN" not in (killed / "record.json").read_text()
    assert "[8/8]" in proc.stdout and ("ETA" in proc.stdout or len(done_before) == 7)

    killed_record = json.loads((killed / "record.json").read_text())
    # the killed run's curve: its first point measured before the kill, every held-out pass once
    assert [p["step"] for p in killed_record["curve"]] == [0, 1, 2, 3]
    assert not (killed / "ckpt").exists()  # a finished run's checkpoints are removed


def test_user_mistakes_are_one_line(tmp_path):
    env = {**os.environ}
    proc = forkserver.run([sys.executable, str(REPO / "tools" / "objective_study.py"), "--megatron", str(tmp_path),
                           "--train-data", "a", "--heldout-data", "b", "--work", str(tmp_path / "w"),
                           "--conditions", "fresh,later"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: unknown condition 'later': choose from fresh, existing"


@pytest.mark.parametrize("option, value, line", [
    ("--curve-points", "0", "--curve-points must be >= 1, got 0"),
    ("--tokens", "-5", "--tokens must be >= 1, got -5"),
    ("--lr", "nan", "--lr must be a positive number, got nan"),
    ("--ranks", "0", "--ranks must be >= 1, got 0"),
])
def test_nonsense_values_are_refused_before_any_work(tmp_path, capsys, option, value, line):
    spec = importlib.util.spec_from_file_location("objective_study_tool", REPO / "tools" / "objective_study.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit) as exit_:
        tool.parse_args(["--megatron", str(tmp_path), "--train-data", "a", "--heldout-data", "b", "--work",
                         str(tmp_path / "w"), option, value])
    assert exit_.value.code == 2 and line in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_finished_runs_of_another_size_are_refused(tmp_path):
    """A --work holding finished runs of other settings is refused in one line, not silently reused."""
    from bebop_megatron.study.driver import StudyPlan, run_folder, run_study
    from bebop_megatron.study.log import StudyError

    plan = StudyPlan(work=tmp_path, out=tmp_path / "out", meg=tmp_path, train_files=[], valid_files=[],
                     objectives=["ce", "kl"], tokens=4096, seq_length=64, global_batch_size=4)
    folder = run_folder(plan, "fresh", "kl", 0)
    folder.mkdir(parents=True)
    (folder / "record.json").write_text(json.dumps({"tokens": 768, "lr": plan.lr}))
    (folder / "rows.npz").write_bytes(b"")
    with pytest.raises(StudyError, match=r"holds a run with \{'tokens': 768, 'lr': 0.001\} but this study asks for "
                                         r"\{'tokens': 4096, 'lr': 0.001\}"):
        run_study(plan)
    assert not run_folder(plan, "fresh", "ce", 0).exists()  # nothing ran


# ----------------------------------------------------------------------------- --ranks N


def test_ranks_2_gives_the_held_out_statistics_of_one_process(dry_run, tmp_path):
    """The same run (the tiny random Llama, fresh e2e_tv head, seed 0, 3 steps, fp32) in one process
    (the dry run's, --ranks 1) and in 2 processes at tensor parallel 2 (--ranks 2, on the dry run's
    import given with --megatron, a copy of its responses, --keep-checkpoints): the same held-out positions and texts, and the same
    statistics up to fp32 rounding. The fresh MTP layer starts alike at both layouts (Megatron's
    CPU initialisation, as tests/distributed/test_layouts.py relies on) and the data order is the
    same (one data-parallel rank); TP changes only the order of sums (the vocabulary-parallel
    softmax, the row-parallel products), about 1e-7 relative per operation, which three Adam
    updates carry into the weights. Tolerance: 1e-4 absolute on probabilities, entropies and
    E[L] (the bound test_layouts.py sets on the loss after three updates); measured here at most
    3.4e-6 (2026-12-06)."""
    import shutil

    study, _, _, _ = dry_run
    two = tmp_path / "two"
    shutil.copytree(study / "work" / "data", two / "data")  # the same import and responses: only the layout differs
    tool = [sys.executable, str(REPO / "tools" / "objective_study.py")]
    sizes = [*STUDY[:STUDY.index("--objectives")], "--objectives", "e2e_tv", "--seeds", "0", "--conditions", "fresh"]
    command = [*tool, "--hf-dir", str(study / "hf"), "--megatron", str(study / "work" / "megatron"), "--prompts",
               str(study / "prompts"), "--work", str(two), *sizes, "--keep-checkpoints"]
    proc = forkserver.run([*command, "--ranks", "2"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"import: {study / 'work' / 'megatron'} (given; the responses come from {study / 'hf'})" in proc.stdout
    assert "responses (" not in proc.stdout and "[1/1] fresh/e2e_tv/seed0" in proc.stdout
    run = "runs/fresh/e2e_tv/seed0"
    r1, r2 = (json.loads((w / run / "record.json").read_text()) for w in (study / "work", two))
    assert r2["ranks"] == 2 and r2["steps"] == r1["steps"] == 3
    assert (two / run / "launch.json").is_file()
    assert (two / run / "ckpt" / "latest").is_file()  # --keep-checkpoints: the last one stays (the dry run's went)
    rows1, rows2 = np.load(study / "work" / run / "rows.npz"), np.load(two / run / "rows.npz")
    assert sorted(rows1.files) == sorted(rows2.files)
    for key in rows1.files:
        a, b = rows1[key], rows2[key]
        assert a.shape == b.shape, key
        if key.endswith(("|chain", "|text")):
            assert (a == b).all(), key  # the same positions of the same texts
        else:
            assert np.abs(a.astype(np.float64) - b).max() <= 1e-4, (key, np.abs(a.astype(np.float64) - b).max())
    for tau in ("1", "0.7"):
        for name, value in r1["metrics"][tau].items():  # null: nothing to measure (e.g. no chain of that length)
            assert r2["metrics"][tau][name] == (None if value is None else pytest.approx(value, abs=1e-4)), (tau, name)
    for p1, p2 in zip(r1["curve"], r2["curve"], strict=True):
        assert p2["step"] == p1["step"] and p2["alpha_rs"] == pytest.approx(p1["alpha_rs"], abs=1e-4)
        assert p2["accept_len_decode_rs"] == pytest.approx(p1["accept_len_decode_rs"], abs=1e-4)
    # a layout the model cannot take: one line, before any run (4 does not divide its 2 key-value heads)
    data = study / "work" / "data"
    bad = forkserver.run([*tool, "--megatron", str(study / "work" / "megatron"), "--train-data", str(data / "train"),
                          "--heldout-data", str(data / "heldout"), "--work", str(tmp_path / "four"), *sizes, "--ranks",
                          "4"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --ranks 4 (tensor parallel 4): parallel.tensor=4 must divide model.num_query_groups=2"), bad.stderr
    assert not (tmp_path / "four" / "runs").exists()
