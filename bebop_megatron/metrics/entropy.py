"""Acceptance against target entropy: least-squares lines, binned means, the RL drift split.

Plain numpy (no process groups): the inputs are per-position values or a time series.

- :func:`fit_line`: alpha ~ a + b H (the paper's Fig. 1a / Fig. 8 slope b).
- :func:`binned_means`: mean acceptance per entropy bin.
- :func:`entropy_mismatch_split`: Eq. 16, d_alpha_t = b (H_t - H_0) + residual, with b fitted
  on the early steps of an RL run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def fit_line(x, y) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``y ~ intercept + slope * x``.

    Raises ``ValueError`` for fewer than 2 points, non-finite values or constant ``x``.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D arrays of equal length, got {x.shape} and {y.shape}")
    if len(x) < 2:
        raise ValueError(f"a line needs at least 2 points, got {len(x)}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite (no NaN or inf)")
    dx = x - x.mean()
    var = float((dx * dx).sum())
    if var == 0.0:
        raise ValueError("x is constant: the slope is undefined")
    slope = float((dx * (y - y.mean())).sum() / var)
    return slope, float(y.mean() - slope * x.mean())


def line_from_moments(n, sx, sy, sxx, sxy) -> tuple[float, float]:
    """:func:`fit_line` from streamed sums (n, sum x, sum y, sum x^2, sum xy); NaNs if undefined."""
    if n < 2:
        return float("nan"), float("nan")
    var = sxx - sx * sx / n
    if not var > 0:
        return float("nan"), float("nan")
    slope = (sxy - sx * sy / n) / var
    return float(slope), float((sy - slope * sx) / n)


def binned_means(x, y, edges) -> tuple[np.ndarray, np.ndarray]:
    """Per bin ``[edges[i], edges[i+1])`` (the last bin closed): ``(counts, mean y)``, NaN where empty."""
    x, y, edges = (np.asarray(a, dtype=np.float64) for a in (x, y, edges))
    index = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
    inside = (x >= edges[0]) & (x <= edges[-1])
    counts = np.bincount(index[inside], minlength=len(edges) - 1).astype(np.float64)
    sums = np.bincount(index[inside], weights=y[inside], minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return counts, np.where(counts > 0, sums / counts, np.nan)


@dataclass
class DriftSplit:
    """Eq. 16 over an RL run: each step's acceptance change from step 0 split in two parts."""

    slope: float  # b: d alpha / d H fitted on the first steps
    intercept: float
    num_fit: int  # steps used for the fit
    delta: np.ndarray  # alpha_t - alpha_0 (alpha_0: the fitted line at H_0, see below)
    entropy_part: np.ndarray  # b (H_t - H_0)
    mismatch_part: np.ndarray  # delta - entropy_part: draft/target mismatch
    mismatch_share: float  # |mismatch| / (|entropy| + |mismatch|) over the steps after the fit window
    final_delta: float  # mean of delta over the last steps (see ``window``)
    final_entropy_part: float
    final_mismatch_part: float


def entropy_mismatch_split(entropy, accept, fit_fraction: float, window: int | None = None) -> DriftSplit:
    """Fit alpha ~ a + b H on the first ``fit_fraction`` of the steps, then split every step's
    change (Eq. 16): alpha_t - alpha_0 = b (H_t - H_0) + residual.

    H_0 and alpha_0 are the means over the fit window (where, by assumption, the draft is
    still matched to the policy), so noise in a single first step does not bias the split.
    ``final_*`` average the last ``window`` steps (default: the length of the fit window).
    The mismatch share is |mean residual| / (|mean entropy part| + |mean residual|) over
    that final window.
    """
    h, a = np.asarray(entropy, dtype=np.float64), np.asarray(accept, dtype=np.float64)
    if h.shape != a.shape or h.ndim != 1:
        raise ValueError(f"entropy and acceptance must be 1-D series of equal length, got {h.shape} and {a.shape}")
    if not 0 < fit_fraction <= 1:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction}")
    num_fit = int(round(fit_fraction * len(h)))
    if num_fit < 3:
        raise ValueError(
            f"too few steps: fit_fraction={fit_fraction} of {len(h)} steps leaves {num_fit} for the fit (need >= 3)"
        )
    slope, intercept = fit_line(h[:num_fit], a[:num_fit])
    h0, a0 = h[:num_fit].mean(), a[:num_fit].mean()
    delta = a - a0
    entropy_part = slope * (h - h0)
    mismatch = delta - entropy_part
    window = num_fit if window is None else max(1, min(window, len(h)))
    fe, fm = float(entropy_part[-window:].mean()), float(mismatch[-window:].mean())
    total = abs(fe) + abs(fm)
    share = abs(fm) / total if total > 0 else 0.0
    return DriftSplit(slope, intercept, num_fit, delta, entropy_part, mismatch, share,
                      float(delta[-window:].mean()), fe, fm)
