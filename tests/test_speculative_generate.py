"""Speculative decoding of whole sequences (``bebop_megatron.speculative.decoding``) and its
Megatron model (``megatron_model.py``), against independent references.

- Table models (a trigram target with a cache that must be rolled back, a per-step bigram
  draft): the joint distribution of the first three generated tokens passes a chi-square
  test against the target's exact joint (products of its conditionals), for RS and
  target-only and several gamma; a draft equal to the target is always accepted and
  every verification emits gamma + 1 tokens.
- The measured acceptance of each draft position agrees with the online alpha of the very
  rows it used (exact in expectation: a martingale) within 4 standard errors.
- A tiny trained Megatron checkpoint (``tests/helpers/speculative_case.py``): the cached
  backbone and the windowed MTP chain reproduce the model's full-sequence forward; the tool
  writes every JSON key; measured vs predicted accepted length (see the helper).
- The tool on an export directory: ``tests/test_convert_export.py``
  (``test_export_from_training_checkpoint``).
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from bebop_megatron.speculative.decoding import (
    Generation,
    autoregressive_generate,
    autoregressive_steps,
    lockstep,
    speculative_generate,
    speculative_steps,
)
from bebop_megatron.speculative.measure import mean_ci, measured
from tests.helpers.cli_batch import run_batch
from tests.helpers.launch import REPO, run_script
from tests.test_speculative import chi_square_pvalue

V = 5


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors, one intra-op thread


class TableModel:
    """Target: p(x_t | x_{t-2}, x_{t-1}) from a table; draft step k: q_k(x | previous token).
    Its "cache" is the token list the target has seen; ``draft`` checks the loop's bookkeeping."""

    def __init__(self, seed: int, draft_is_target: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.target = torch.randn(V, V, V, generator=g, dtype=torch.float64) * 1.5
        self.steps = torch.randn(4, V, V, generator=g, dtype=torch.float64) * 1.5
        self.draft_is_target = draft_is_target
        self.seen: list[int] = []
        self.pending = 0

    def _p(self, seq):
        return self.target[seq[-2], seq[-1]]

    def prefill(self, prompt):
        self.seen = list(prompt)
        return self._p(self.seen)

    def draft(self, tokens, gamma, pick):
        assert tokens[:-1] == self.seen, "the newest token must not be in the target's cache"
        ext, drafts, logits = list(tokens), [], []
        for k in range(gamma):
            row = self._p(ext) if self.draft_is_target else self.steps[k, ext[-1]]
            y = pick(row)
            drafts.append(y)
            logits.append(row)
            ext.append(y)
        return drafts, torch.stack(logits)

    def verify(self, new_tokens):
        rows = []
        for t in new_tokens:
            self.seen.append(t)
            rows.append(self._p(self.seen))
        self.pending = len(new_tokens)
        return torch.stack(rows)

    def keep(self, n):
        del self.seen[len(self.seen) - self.pending + n:]

    def teacher_forced_logits(self, tokens, gamma, first, state_tokens=None, partial=False):
        """Step k at t: q_k(. | x_{t+k}) and its target p(. | x_{t+k-1}, x_{t+k}) (zeros past the end)."""
        L = len(tokens)
        last = L - 2 if partial else L - 1 - gamma
        if last < first:
            return None, None
        draft = torch.zeros(gamma, last + 1 - first, V, dtype=torch.float64)
        target = torch.zeros_like(draft)
        for k in range(1, gamma + 1):
            for i, t in enumerate(range(first, min(last, L - 1 - k) + 1)):
                draft[k - 1, i] = self._p(tokens[: t + k + 1]) if self.draft_is_target else self.steps[k - 1, tokens[t + k]]
                target[k - 1, i] = self._p(tokens[: t + k + 1])
        return draft, target


def exact_joint(model: TableModel, prompt, temperature: float) -> torch.Tensor:
    """P(y1, y2, y3) under the target, ``[V**3]``."""
    out = torch.zeros(V, V, V, dtype=torch.float64)
    for y in itertools.product(range(V), repeat=3):
        seq, prob = list(prompt), 1.0
        for t in y:
            prob *= float(torch.softmax(model._p(seq) / temperature, -1)[t])
            seq.append(t)
        out[y] = prob
    return out.flatten()


@pytest.mark.parametrize("mode,gamma,temperature", [("rs", 2, 1.0), ("rs", 3, 0.7), ("to", 2, 1.0)])
def test_output_distribution_is_the_targets(mode, gamma, temperature):
    model, prompt, trials = TableModel(seed=1), [0, 3], 4000
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for _ in range(trials):
        out = speculative_generate(model, prompt, gamma=gamma, temperature=temperature, max_new_tokens=3, mode=mode,
                                   generator=g)
        y = out.new_tokens
        assert len(y) == 3
        counts[(y[0] * V + y[1]) * V + y[2]] += 1
    probs = exact_joint(model, prompt, temperature)
    assert chi_square_pvalue(counts, probs) > 1e-3
    # the test has power: the drafts' own joint distribution is rejected
    draft_joint = torch.zeros(V ** 3, dtype=torch.float64)
    first = torch.softmax(model._p(prompt) / temperature, -1)
    for y in itertools.product(range(V), repeat=3):
        q2 = torch.softmax(model.steps[0, y[0]] / temperature, -1)
        q3 = torch.softmax(model.steps[1, y[1]] / temperature, -1)
        draft_joint[(y[0] * V + y[1]) * V + y[2]] = first[y[0]] * q2[y[1]] * q3[y[2]]
    assert chi_square_pvalue(counts, draft_joint) < 1e-6


def test_plain_decoding_distribution():
    model, prompt = TableModel(seed=2), [1, 1]
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for _ in range(3000):
        y = autoregressive_generate(model, prompt, temperature=1.0, max_new_tokens=3, generator=g).new_tokens
        counts[(y[0] * V + y[1]) * V + y[2]] += 1
    assert chi_square_pvalue(counts, exact_joint(model, prompt, 1.0)) > 1e-3


@pytest.mark.parametrize("mode", ["rs", "to"])
def test_draft_equal_to_target_is_always_accepted(mode):
    model, gamma = TableModel(seed=4, draft_is_target=True), 3
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(model, [2, 4], gamma=gamma, temperature=1.0, max_new_tokens=41, mode=mode,
                               generator=g)
    stats = measured([out], gamma)
    if mode == "rs":  # p == q: u * q < p for every u < 1
        assert all(r.num_accepted == gamma for r in out.rounds)
        assert stats["measured_accept_len"] == gamma and stats["tokens_per_target_forward"] == gamma + 1
        assert all(p["rate"] == 1.0 and p["online_alpha"] == pytest.approx(1.0) for p in stats["per_position"])
    else:  # greedy drafts of q = p are accepted with p(argmax p): each online alpha is some row's max
        maxima = torch.softmax(model.target, -1).amax(-1).flatten().tolist()
        for r in out.rounds:
            assert all(min(abs(a - m) for m in maxima) < 1e-12 for a in r.online_alpha)
    assert len(out.new_tokens) == 41


@pytest.mark.parametrize("mode", ["rs", "to"])
def test_measured_rate_matches_online_alpha(mode):
    """Each verification reaching draft i accepts it with probability alpha_i of its own rows."""
    model, gamma = TableModel(seed=5), 3
    g = torch.Generator().manual_seed(11)
    gens = [speculative_generate(model, [0, 1], gamma=gamma, temperature=1.0, max_new_tokens=60, mode=mode,
                                 generator=g) for _ in range(40)]
    stats = measured(gens, gamma)
    for p in stats["per_position"]:
        reach = p["attempts"]
        assert reach > 50
        se = math.sqrt(0.25 / reach)
        assert abs(p["rate"] - p["online_alpha"]) < 4 * se, p
    lengths = [r.num_accepted for x in gens for r in x.rounds]
    assert stats["measured_accept_len"] == pytest.approx(sum(lengths) / len(lengths))
    mean, (lo, hi) = mean_ci(lengths)
    assert lo < mean < hi and stats["ci95"] == [lo, hi]


def test_megatron_model_and_tool(tmp_path):
    """Tiny trained checkpoint: exactness against the full forward, the tool's JSON, measured
    vs predicted (the helper prints its numbers as JSON)."""
    save = tmp_path / "run"
    # The embedded default fits a synthetic backbone into the user's cache: a random one here.
    run_script(str(REPO / "examples" / "pretrain_mtp.py"), ["parallel.tensor=1", "train.steps=3",
                                                            "model.backbone_init=random", f"save.dir={save}"], nproc=1)
    # In one process: the exactness case (tests/helpers/speculative_case.py), the tool (as its
    # __main__ runs it) and the tool's one-line error for a missing checkpoint.
    out = tmp_path / "spec.json"
    tool = ["--checkpoint", str(save), "--prompts", str(REPO / "examples" / "data" / "tiny_valid.jsonl"),
            "--limit", "3", "--gamma", "2", "--max-new-tokens", "12", "--baseline", "--batch-size", "2",
            "--json", str(out)]
    too_far = [*tool[:4], "--limit", "1", "--max-new-tokens", "4", "--gamma", "100",
               "--json", str(tmp_path / "far.json")]
    single_out = tmp_path / "single.json"
    case, proc, bad, far, single = run_batch(
        [{"tool": "tests/helpers/speculative_case.py", "argv": [str(save)]},
         {"tool": "speculative_generate", "argv": tool},
         {"tool": "speculative_generate", "argv": [tool[0], str(tmp_path / "missing")] + tool[2:]},
         {"tool": "speculative_generate", "argv": too_far},
         {"tool": "speculative_generate", "argv": [*tool[:-2], "--decoder", "single", "--json", str(single_out)]}],
        tmp_path / "batch")
    assert case.returncode == 0, case.stderr[-3000:]
    result = json.loads(case.stdout.strip().splitlines()[-1])
    assert result["backbone_max_diff"] < 1e-4 and result["draft_max_diff"] < 1e-4
    assert result["teacher_forced_max_diff"] < 1e-4
    for gamma, run in result["runs"].items():
        # measured vs predicted: within 4 standard errors of the measured mean (CLT over verifications)
        se = run["measured_se"]
        assert run["num_verifications"] >= 40
        assert abs(run["measured_accept_len"] - run["predicted_accept_len_at_starts"]) < 4 * se + 1e-9, run
        assert abs(run["measured_accept_len"] - run["predicted_accept_len"]) < 4 * se + 0.02, run
        assert abs(run["measured_accept_len"] - run["predicted_accept_len_decode"]) < 4 * se, run
        # draft 1 of a verification sees only accepted tokens, so its online alpha is the
        # teacher-forced alpha at that start: for gamma = 1 the two predictions coincide
        if gamma == "1":
            assert run["per_position"][0]["online_alpha"] == pytest.approx(run["predicted_accept_len_at_starts"],
                                                                           abs=1e-5)

    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("measured_accept_len", "ci95", "per_position", "tokens_per_target_forward", "wall_seconds",
                "predicted_accept_len", "predicted_accept_len_at_starts", "predicted_accept_len_decode",
                "predicted_decode_ci95", "expected_verifications", "speedup", "texts", "baseline"):
        assert key in report, key
    assert len(report["per_position"]) == 2 and len(report["texts"]) == 3
    assert set(report["wall_seconds"]) == {"target", "draft", "prefill"}
    assert 1.0 <= report["tokens_per_target_forward"] <= 3.0
    # the batched decoder (the default; batches of 2 for 3 prompts) and --decoder single: the same
    # texts and acceptance counts for the same seed (tests/test_speculative_batched.py: why)
    assert single.returncode == 0, single.stderr[-3000:]
    one = json.loads(single_out.read_text())
    assert report["texts"] == one["texts"] and report["num_verifications"] == one["num_verifications"]
    assert [p["accepted"] for p in report["per_position"]] == [p["accepted"] for p in one["per_position"]]
    assert report["tokens_per_second"] > 0 and "tokens/s (batched, batch 2)" in proc.stdout

    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "checkpoint not found" in bad.stderr
    # --gamma far above the trained steps, the one MTP layer reused: the draft positions no
    # verification reached have no rate, written as null, not as a bare NaN (issue 36 item 11)
    assert far.returncode == 0, far.stderr[-3000:]

    def no_constants(name):
        raise AssertionError(f"bare {name} in the JSON")

    far_report = json.loads((tmp_path / "far.json").read_text(), parse_constant=no_constants)
    rates = [p["rate"] for p in far_report["per_position"]]
    assert len(rates) == 100 and rates[-1] is None and rates[0] is not None


@pytest.mark.parametrize("mode", ["rs", "to"])
def test_decode_exact_forecast_matches_measured(mode):
    """run_config's decode-exact forecast (the recursion on each emitted text, with decoding's
    max_new_tokens and stop token) against the counted accepted drafts and verifications of
    many decodings: within their Monte-Carlo error, where Eq. 12 over every position is not."""
    from bebop_megatron.speculative.session import run_config

    prompts = [[i % V, (3 * i + 1) % V] for i in range(150)]
    r = run_config(TableModel(3), prompts, gamma=3, temperature=1.0, mode=mode, max_new_tokens=24, seed=5,
                   stop_ids={V - 1})
    se = r["measured_se"]
    assert r["num_verifications"] > 500
    assert abs(r["measured_accept_len"] - r["predicted_accept_len_decode"]) < 4 * se, r
    lo, hi = r["predicted_decode_ci95"]
    assert lo < r["predicted_accept_len_decode"] < hi
    assert abs(r["expected_verifications"] - r["num_verifications"]) < 4 * r["num_verifications"] ** 0.5
    if mode == "to":  # greedy drafts: acceptance given the text is 0 or 1, so the recursion replays the decoding
        assert r["predicted_accept_len_decode"] == pytest.approx(r["measured_accept_len"], abs=1e-12)
        assert r["expected_verifications"] == r["num_verifications"]
        assert abs(r["predicted_accept_len"] - r["measured_accept_len"]) > 0.02  # Eq. 12 over positions is not


def test_lockstep_equals_separate_runs():
    """Interleaving plain and speculative decoding (two caches) changes neither output."""
    kw = dict(temperature=1.0, max_new_tokens=20)
    plain_ref = autoregressive_generate(TableModel(6), [0, 2], generator=torch.Generator().manual_seed(1), **kw)
    spec_ref = speculative_generate(TableModel(6), [0, 2], gamma=2, mode="rs",
                                    generator=torch.Generator().manual_seed(2), **kw)
    plain, spec = Generation(2, [0, 2]), Generation(2, [0, 2])
    lockstep(autoregressive_steps(TableModel(6), plain, generator=torch.Generator().manual_seed(1), **kw),
             speculative_steps(TableModel(6), spec, gamma=2, mode="rs", generator=torch.Generator().manual_seed(2),
                               **kw))
    assert plain.tokens == plain_ref.tokens and spec.tokens == spec_ref.tokens
    assert [r.num_accepted for r in spec.rounds] == [r.num_accepted for r in spec_ref.rounds]

