"""The speed-up cost model (``bebop_megatron/metrics/speedup.py``) against hand-computed float64 values."""

from __future__ import annotations

import pytest

from bebop_megatron.metrics.speedup import Costs, best_gamma, expected_speedup, speedup_table


def accept_len(alphas):
    """Eq. 12 by hand: E[L](g) = sum_{j<=g} prod_{i<=j} alpha_i."""
    out, prod, total = [], 1.0, 0.0
    for a in alphas:
        prod *= a
        total += prod
        out.append(total)
    return out


def test_formula_by_hand():
    e = accept_len([0.8, 0.8, 0.8])
    assert e == pytest.approx([0.8, 1.44, 1.952], abs=1e-15)
    costs = Costs.from_times(target_ms=10.0, draft_ms=1.0, overhead_ms=0.5)
    assert (costs.draft_ratio, costs.overhead) == (0.1, 0.05)
    got = expected_speedup(e, costs.draft_ratio, costs.overhead)
    assert got == pytest.approx([1.8 / 1.15, 2.44 / 1.25, 2.952 / 1.35], rel=1e-15)
    assert best_gamma(got) == (3, pytest.approx(2.952 / 1.35, rel=1e-15))


def test_costly_drafts_cap_the_best_gamma():
    # A draft step at a fifth of a target forward: the third draft costs more than it brings.
    e = accept_len([0.9, 0.6, 0.3])
    got = expected_speedup(e, 0.2)
    want = [(1 + 0.9) / 1.2, (1 + 0.9 + 0.54) / 1.4, (1 + 0.9 + 0.54 + 0.162) / 1.6]
    assert got == pytest.approx(want, rel=1e-15)
    assert best_gamma(got)[0] == 2


def test_no_gamma_beats_plain_decoding():
    got = expected_speedup(accept_len([0.05, 0.05]), 0.5)
    assert all(s < 1 for s in got)
    assert best_gamma(got) == (0, 1.0)


def test_table_per_temperature_and_the_cap_note():
    per_t = {"1": {"accept_len_rs": accept_len([0.7, 0.6]), "accept_len_to": accept_len([0.3, 0.2])},
             "0.5": {"accept_len_rs": accept_len([0.9, 0.9]), "accept_len_to": accept_len([0.8, 0.7])}}
    table = speedup_table(per_t, Costs.from_ratio(0.2), num_positions=3)
    assert table["max_gamma"] == 2 and "2 of 3" not in table["note"]
    assert "3 draft positions" in table["note"] and "--gamma 3" in table["note"]
    for tau, entry in per_t.items():
        row = table["per_temperature"][tau]
        assert row["gamma"] == [1, 2]
        for which in ("rs", "to"):
            want = [(1 + e) / (1 + g * 0.2) for g, e in enumerate(entry[f"accept_len_{which}"], start=1)]
            assert row[f"speedup_{which}"] == pytest.approx(want, rel=1e-15)
            g = max(range(2), key=lambda i: want[i])
            assert (row[f"best_gamma_{which}"], row[f"best_speedup_{which}"]) == (g + 1, pytest.approx(want[g]))
    assert table["per_temperature"]["0.5"]["best_speedup_rs"] > table["per_temperature"]["1"]["best_speedup_rs"]


@pytest.mark.parametrize("bad", [dict(target_ms=0.0, draft_ms=1.0), dict(target_ms=1.0, draft_ms=-1.0),
                                 dict(target_ms=1.0, draft_ms=1.0, overhead_ms=-0.1)])
def test_bad_times_are_refused(bad):
    with pytest.raises(ValueError, match="cost times"):
        Costs.from_times(**bad)

