"""``bebop_megatron.metrics`` against a float64 plain-torch reference written here (loops over
positions and chain steps, full softmaxes), on odd shapes with cut chains and temperatures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bebop_megatron.metrics import (
    accept_length_sums,
    acceptance_stats,
    binned_means,
    entropy_mismatch_split,
    fit_line,
    line_from_moments,
)

K, N, V = 3, 41, 401


def make_inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = 2.0 * torch.randn(K, N, V, generator=g, dtype=torch.float64)
    draft = 0.7 * target + torch.randn(K, N, V, generator=g, dtype=torch.float64)
    draft[0, 3, 10] = draft[0, 3, 200] = 50.0  # argmax tie: alpha_TO must take the lowest index
    target[0, 3, 200] = 40.0
    valid = torch.rand(K, N, generator=g) > 0.15
    valid[:, 0] = False  # no chain
    valid[:, 1] = torch.tensor([True, False, True])  # cut after step 1: step 3 must not count
    valid[:, 3] = True
    labels = torch.randint(0, V, (K, N), generator=g)
    labels[:, 2] = draft[:, 2].argmax(-1)  # some hits for top1
    return draft.to(dtype), target.to(dtype), valid, labels


def reference(draft, target, valid, labels, tau_t, tau_d):
    """DESIGN.md section 1, literally: per position, per step of its chain."""
    draft, target = draft.double(), target.double()
    out = {k: torch.zeros(K, dtype=torch.float64) for k in
           ("alpha_rs", "alpha_to", "entropy_target", "entropy_draft", "kl", "top1", "accept_len_rs",
            "accept_len_to", "count")}
    for t in range(N):
        prod_rs = prod_to = 1.0
        len_rs = len_to = 0.0
        for k in range(K):
            if not bool(valid[k, t]):
                break  # a chain stops at its first invalid step
            p = torch.softmax(target[k, t] / tau_t, -1)
            q = torch.softmax(draft[k, t] / tau_d, -1)
            y = int(torch.argmax(draft[k, t]))  # first maximal index
            a_rs, a_to = float(torch.minimum(p, q).sum()), float(p[y])
            prod_rs, prod_to = prod_rs * a_rs, prod_to * a_to
            len_rs, len_to = len_rs + prod_rs, len_to + prod_to
            out["alpha_rs"][k] += a_rs
            out["alpha_to"][k] += a_to
            out["entropy_target"][k] += float(-(p * p.log()).sum())
            out["entropy_draft"][k] += float(-(q * q.log()).sum())
            out["kl"][k] += float((p * (p.log() - q.log())).sum())
            out["top1"][k] += float(y == int(labels[k, t]))
            out["accept_len_rs"][k] += len_rs
            out["accept_len_to"][k] += len_to
            out["count"][k] += 1
    return {k: (v if k == "count" else v / out["count"].clamp(min=1)) for k, v in out.items()}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("temps", [(1.0, 1.0), (0.7, 1.3)])
def test_acceptance_stats_matches_reference(dtype, tol, temps):
    draft, target, valid, labels = make_inputs(dtype)
    got = acceptance_stats(draft, target, valid, labels=labels, target_temperature=temps[0],
                           draft_temperature=temps[1], chunk_tokens=17)  # chunks smaller than K*N
    want = reference(draft, target, valid, labels, *temps)
    assert set(want) <= set(got)
    for name, value in want.items():
        assert got[name].shape == (K,), name
        torch.testing.assert_close(got[name].double(), value, rtol=tol, atol=tol, msg=name)


def test_accept_len_is_per_position_not_product_of_means():
    # Two positions: alphas (1, 1) and (0, 0). Per position E[L](2) = (2 + 0) / 2 = 1;
    # the product of the averaged alphas would give 0.5 + 0.25 = 0.75.
    alpha = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    valid = torch.ones(2, 2, dtype=torch.bool)
    sums, counts = accept_length_sums(alpha, valid)
    torch.testing.assert_close(sums / counts, torch.tensor([0.5, 1.0], dtype=torch.float64))


def test_accept_length_sums_respects_chains():
    alpha = torch.tensor([[0.5, 0.8, 0.9], [0.5, float("nan"), 0.1], [0.5, 0.3, 0.2]], dtype=torch.float64)
    valid = torch.tensor([[True, True, False], [True, False, True], [True, True, True]])
    sums, counts = accept_length_sums(alpha, valid)
    # chains: t0 reaches 3, t1 reaches 1 (nan at an invalid step ignored), t2 reaches 0
    torch.testing.assert_close(counts, torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64))
    want = torch.tensor([0.5 + 0.8, 0.5 + 0.25, 0.5 + 0.25 + 0.125], dtype=torch.float64)
    torch.testing.assert_close(sums, want)


def test_acceptance_stats_rejects_bad_shapes():
    draft, target, valid, _ = make_inputs()
    with pytest.raises(ValueError, match="valid must be"):
        acceptance_stats(draft, target, valid[:, :5])
    with pytest.raises(ValueError, match="must both be"):
        acceptance_stats(draft, target[:, :5], valid)


def test_fit_line_and_bins():
    x = np.linspace(0, 4, 50)
    slope, intercept = fit_line(x, 0.9 - 0.1 * x)
    assert math.isclose(slope, -0.1, abs_tol=1e-12) and math.isclose(intercept, 0.9, abs_tol=1e-12)
    moments = line_from_moments(len(x), x.sum(), (0.9 - 0.1 * x).sum(), (x * x).sum(), (x * (0.9 - 0.1 * x)).sum())
    assert np.allclose(moments, (slope, intercept))
    counts, means = binned_means([0.1, 0.2, 1.5, 4.0], [1.0, 3.0, 5.0, 7.0], [0.0, 1.0, 2.0, 3.0, 4.0])
    assert counts.tolist() == [2, 1, 0, 1] and means[0] == 2.0 and np.isnan(means[2]) and means[3] == 7.0
    with pytest.raises(ValueError, match="constant"):
        fit_line([1.0, 1.0], [0.0, 1.0])


def test_entropy_mismatch_split_exact_on_noiseless_series():
    steps = np.arange(200)
    h = 1.0 + 0.5 * np.sin(steps / 7.0)  # entropy moves from the start, so b is identifiable
    mismatch = np.where(steps >= 100, -0.05, 0.0)
    a = 0.8 - 0.2 * h + mismatch
    split = entropy_mismatch_split(h, a, fit_fraction=0.25)
    assert math.isclose(split.slope, -0.2, rel_tol=1e-9)
    assert np.allclose(split.mismatch_part, mismatch, atol=1e-12)
    with pytest.raises(ValueError, match="too few steps"):
        entropy_mismatch_split(h[:8], a[:8], fit_fraction=0.25)


def test_acceptance_report_bins_fits_and_simulation():
    from bebop_megatron.metrics import acceptance_rows
    from bebop_megatron.metrics.report import AcceptanceReport

    draft, target, valid, labels = make_inputs(torch.float64, seed=3)
    target = target * torch.linspace(0.05, 1.5, N, dtype=torch.float64)[None, :, None]  # spread H(p)
    chain = valid.long().cumprod(0).bool()
    edges = [0.0, 2.0, 4.0, 5.0, 7.0]
    report = AcceptanceReport([1.0], K, 2, edges, num_scatter=10)
    for cols in (slice(0, 20), slice(20, N)):  # two chunks add up
        rows = acceptance_rows(draft[:, cols], target[:, cols])
        report.add_rows(0, rows, chain[:, cols], labels[:, cols])
    entry = report.summary()["1"]
    rows = acceptance_rows(draft, target)
    h, a_rs, a_to = (rows[k][chain].numpy() for k in ("entropy_target", "alpha_rs", "alpha_to"))
    counts, means = binned_means(h, a_rs, edges)
    assert entry["entropy_bins"]["count"] == counts.tolist()
    assert np.allclose([np.nan if v is None else v for v in entry["entropy_bins"]["alpha_rs"]], means, equal_nan=True)
    slope, intercept = fit_line(h, a_to)
    assert math.isclose(entry["entropy_fit"]["to"]["slope"], slope, rel_tol=1e-9)
    wins = [float((rows["alpha_rs"][k][chain[k]] > rows["alpha_to"][k][chain[k]]).double().mean()) for k in range(K)]
    assert np.allclose(entry["rs_win_fraction"], wins)
    assert len(report.scatter[0]) == 10 and entry["accept_len_rs"] == pytest.approx(
        acceptance_stats(draft, target, valid)["accept_len_rs"][:2].tolist())

    # Simulation: 4 positions x 500 trials of gamma = 2 against E[L] per position (Eq. 12).
    p = torch.softmax(target[:2, 2:6].double(), -1).transpose(0, 1)  # [n, G, V]
    q = torch.softmax(draft[:2, 2:6].double(), -1).transpose(0, 1)
    report.simulate(0, p, q, trials=500, generator=torch.Generator().manual_seed(0))
    entry = report.summary()["1"]
    alpha = torch.minimum(p, q).sum(-1)  # [n, G]
    want = alpha.cumprod(-1).cumsum(-1).mean(0)
    assert entry["num_simulated_chains"] == 2000
    assert np.allclose(entry["empirical_accept_len_rs"], want.tolist(), atol=0.06)


def test_position_buckets_follow_the_rows_length():
    """The acceptance-by-position buckets split the rows' length (train.seq_length) in 4, so every
    bucket of a 64-token row holds positions (the fixed edges put them all in 0-512); alpha_RS per
    bucket against the plain mean over the bucket's chained positions."""
    from bebop_megatron.metrics.report import POSITION_EDGES, AcceptanceReport, position_edges

    assert position_edges(None) == POSITION_EDGES
    assert position_edges(64) == (0, 16, 32, 48) and position_edges(3) == (0, 1, 2)
    K, B, S = 2, 3, 64
    gen = torch.Generator().manual_seed(0)
    alpha = torch.rand(K, B, S, generator=gen, dtype=torch.float64)
    chain = torch.rand(K, B, S, generator=gen) < 0.8
    chain[1] &= chain[0]
    positions = torch.arange(S).expand(B, S)
    report = AcceptanceReport([1.0], K, K, [0.0, 10.0], num_scatter=0, max_position=S)
    report.add_position_rows(0, alpha, chain, positions)
    out = report.position_summary(0)
    assert out["buckets"] == ["0-16", "16-32", "32-48", "48-64"]
    for i, lo in enumerate((0, 16, 32, 48)):
        sel = chain[:, :, lo:lo + 16]
        assert out["count"][i] == int(sel[0].sum()) > 0
        for k in range(K):
            want = float(alpha[k, :, lo:lo + 16][sel[k]].mean())
            assert out["alpha_rs"][k][i] == pytest.approx(want, rel=1e-12)
