"""Tables of the real-model benchmark: acceptance with bootstrap 95% intervals over held-out positions.

Input per run: the per-position rows ``tools/eval_acceptance.py --positions-out`` saves
(``{temperature: {"chain", "alpha_rs", "alpha_to", "entropy_target": [K, N]}}``). Per
temperature and run:

- ``alpha_rs_step{k}``: mean alpha_RS over the positions whose chain reaches step k;
- ``accept_len_rs_g{G}`` / ``accept_len_to_g{G}``: E[L](G) = sum_{j<=G} prod_{i<=j} alpha_i
  (Eq. 12) per position, averaged over positions whose chain reaches G (as the report);
- ``entropy_slope_rs``: least-squares slope of step-1 alpha_RS against H(p) (nats).

Intervals: percentile bootstrap over positions (positions resampled with replacement, the
statistic recomputed; ``num_boot`` resamples, fixed seed). Positions of one response are
correlated, so these intervals are narrower than intervals over responses would be.
"""

from __future__ import annotations

import numpy as np

# The per-position statistics live in the package (the objective study uses them too).
from bebop_megatron.study.intervals import point_metrics  # noqa: F401  (re-exported)
from bebop_megatron.study.intervals import position_columns as _columns
from bebop_megatron.study.intervals import weighted_metrics as _weighted

METRIC_ORDER = ("alpha_rs_step", "accept_len_rs", "accept_len_to", "entropy_slope_rs")


def temp_suffix(tau: float) -> str:
    """``T1`` for 1.0, ``T0.7`` for 0.7 (metric names: ``accept_len_rs_g3_T1``)."""
    return f"T{tau:g}"


def bootstrap(rows: dict, gamma: int, num_boot: int = 1000, seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """``name -> (value, low, high)``: the point value and the percentile 95% interval.

    Each resample draws ``n`` positions with replacement (``rng.integers(0, n, n)``) and
    recomputes every statistic; as multiplicities of the positions, the statistics are
    weighted sums of per-position vectors (:func:`_columns`), so a resample costs a few dot
    products instead of the statistics' full computation."""
    rows = {k: np.asarray(v) for k, v in rows.items()}
    n = rows["chain"].shape[1]
    point = point_metrics(rows, gamma)
    cols = _columns(rows, gamma)
    rng = np.random.default_rng(seed)
    samples: dict[str, list[float]] = {k: [] for k in point if k != "num_positions"}
    for _ in range(num_boot):
        m = _weighted(cols, np.bincount(rng.integers(0, n, n), minlength=n).astype(np.float64))
        for k in samples:
            samples[k].append(m[k])
    out = {}
    for k, values in samples.items():
        v = np.asarray(values)
        v = v[np.isfinite(v)]
        lo, hi = (np.percentile(v, [2.5, 97.5]) if len(v) else (float("nan"), float("nan")))
        out[k] = (point[k], float(lo), float(hi))
    out["num_positions"] = (point["num_positions"],) * 3
    return out


def _cell(v: tuple[float, float, float], digits: int = 3) -> str:
    value, lo, hi = v
    if not np.isfinite(value):
        return "n/a"
    return f"{value:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def markdown_table(results: dict[str, dict[str, dict]], temperatures, num_steps: int, gamma: int) -> str:
    """``results[run][temperature key] = bootstrap(...)`` -> one markdown table, a row per run and T."""
    head = ["run", "T", *[f"alpha_RS step {k}" for k in range(1, num_steps + 1)],
            f"E[L]({gamma}) RS", f"E[L]({gamma}) TO", "slope RS vs H(p)", "positions"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run, per_t in results.items():
        for tau in temperatures:
            b = per_t[temp_suffix(tau)]
            cells = [run, f"{tau:g}", *[_cell(b[f"alpha_rs_step{k}"]) for k in range(1, num_steps + 1)],
                     _cell(b[f"accept_len_rs_g{gamma}"]), _cell(b[f"accept_len_to_g{gamma}"]),
                     _cell(b["entropy_slope_rs"]), str(b["num_positions"][0])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def csv_metrics(per_t: dict[str, dict], temperatures, num_steps: int, gamma: int) -> dict[str, float]:
    """The CSV metrics of one run: ``accept_len_rs_g3_T1``, ``alpha_rs_step1_T1``, ... with
    ``_lo`` / ``_hi`` bounds of their 95% intervals."""
    out = {}
    for tau in temperatures:
        suffix = temp_suffix(tau)
        b = per_t[suffix]
        names = [*(f"alpha_rs_step{k}" for k in range(1, num_steps + 1)), f"accept_len_rs_g{gamma}",
                 f"accept_len_to_g{gamma}", "entropy_slope_rs"]
        for name in names:
            value, lo, hi = b[name]
            out[f"{name}_{suffix}"] = value
            out[f"{name}_{suffix}_lo"] = lo
            out[f"{name}_{suffix}_hi"] = hi
    return out


__all__ = ["bootstrap", "csv_metrics", "markdown_table", "point_metrics", "temp_suffix"]


def paired_difference(rows_a: dict, rows_b: dict, gamma: int, names, num_boot: int = 1000,
                      seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """``name -> (a - b, low, high)`` over the same held-out positions (paired bootstrap: one
    resample of positions serves both runs). Both runs must hold the same positions."""
    rows_a = {k: np.asarray(v) for k, v in rows_a.items()}
    rows_b = {k: np.asarray(v) for k, v in rows_b.items()}
    if rows_a["chain"].shape != rows_b["chain"].shape or not (rows_a["chain"] == rows_b["chain"]).all():
        raise ValueError("paired_difference needs the same held-out positions in both runs")
    n = rows_a["chain"].shape[1]
    pa, pb = point_metrics(rows_a, gamma), point_metrics(rows_b, gamma)
    cols_a, cols_b = _columns(rows_a, gamma), _columns(rows_b, gamma)
    rng = np.random.default_rng(seed)
    samples = {k: [] for k in names}
    for _ in range(num_boot):
        w = np.bincount(rng.integers(0, n, n), minlength=n).astype(np.float64)
        ma, mb = _weighted(cols_a, w), _weighted(cols_b, w)
        for k in names:
            samples[k].append(ma[k] - mb[k])
    out = {}
    for k in names:
        v = np.asarray(samples[k])
        v = v[np.isfinite(v)]
        lo, hi = np.percentile(v, [2.5, 97.5]) if len(v) else (float("nan"), float("nan"))
        out[k] = (pa[k] - pb[k], float(lo), float(hi))
    return out
