"""Held-out statistics of a trained head and their 95% intervals: over seeds (the unit), and over responses.

Legend: K MTP steps, G gamma, N positions, n texts (held-out responses), S seeds.

Input: per-position rows (``{"chain", "alpha_rs", "alpha_to", "entropy_target": [K, N]}``,
what ``tools/eval_acceptance.py --positions-out`` and :func:`bebop_megatron.study.runs.held_out_rows`
keep) with the text (response) of every position, and optionally the decode-exact sums per text
(:mod:`bebop_megatron.chain.decode_exact`: expected accepted drafts and verifications).

Every statistic is a ratio of sums over positions, or (the entropy slope) a function of five
sums, so it is a function of per-text sums: :func:`text_columns`. A bootstrap resample is then
a vector of multiplicities over texts, and a statistic of the resample a few dot products
(:func:`weighted_metrics`).

- ``alpha_rs_step{k}`` / ``alpha_to_step{k}``: mean alpha over the positions whose chain reaches step k;
- ``accept_len_rs_g{G}`` / ``accept_len_to_g{G}``: Eq. 12, E[L](G) = sum_{j<=G} prod_{i<=j} alpha_i per
  position, averaged over the positions whose chain reaches G;
- ``accept_len_decode_rs_g{G}`` / ``..._to_g{G}``: the decode-exact E[L](G), pooled accepted drafts over
  pooled verifications (what speculative decoding measures);
- ``entropy_slope_rs``: least-squares slope of step-1 alpha_RS against the target's entropy (nats).

Intervals, with the **seed** as the unit (docs/study.md, "How the intervals are computed"): a
run's statistic over every held-out text is one number per seed; a paired difference is one
number per seed (the runs of one seed share their initialisation, data order and held-out texts).

- :func:`t_interval`: the paired t-interval over seeds, mean +- t(S-1) * sd / sqrt(S) (Student t
  with S - 1 degrees of freedom, :func:`t_quantile`); the study's interval. It needs S >= 2.
- :func:`hierarchical_bootstrap`: the check. One resample draws S seeds with replacement
  (``rng.integers(0, S, S)``, outer) and the n texts (``rng.integers(0, n, n)``, inner), drawn
  as ``[num_boot, S]`` seeds, then ``[num_boot, n]`` texts. One draw of texts serves the drawn
  seeds, as every seed is evaluated on the same texts: the difference stays paired. Its value is
  the mean over the drawn seeds of each seed's statistic over the drawn texts. Resampling S seeds
  from S shrinks their variance by (S-1)/S and the percentiles of a 3-seed resample cannot reach
  past the extreme seeds, so the interval is the bootstrap's standard error, corrected by
  sqrt(S/(S-1)), times the t(S-1) quantile, around the value. It adds the uncertainty of the
  texts every seed shares (and counts each seed's own text noise twice: it errs wide); with no
  text noise it is the t-interval.
- :func:`paired_bootstrap` / :func:`response_bootstrap`: responses only, seeds fixed (the mean over
  every seed of its statistic over the drawn texts; percentile interval): what another set of
  held-out prompts would change, not what another training seed would. Labelled as such.

1000 resamples (``num_boot``) from a fixed seed. Positions of one response are correlated, so
resampling positions (:func:`position_bootstrap`, the older tables') gives intervals that are
too narrow.
"""

from __future__ import annotations

import functools
import math

import numpy as np

SLOPE = "_slope"


def point_metrics(rows: dict, gamma: int) -> dict[str, float]:
    """The statistics of one set of per-position rows (numpy arrays ``[K, N]``)."""
    chain = np.asarray(rows["chain"], dtype=bool)
    out = {}
    K = chain.shape[0]
    for name in ("alpha_rs", "alpha_to"):
        a = np.asarray(rows[name], dtype=np.float64)
        for k in range(K):
            m = chain[k]
            out[f"{name}_step{k + 1}"] = float(a[k, m].mean()) if m.any() else float("nan")
        full = chain[gamma - 1]
        accept_len = np.cumsum(np.cumprod(a[:gamma], axis=0), axis=0)[gamma - 1]
        out[f"accept_len_{name[-2:]}_g{gamma}"] = float(accept_len[full].mean()) if full.any() else float("nan")
    m = chain[0]
    h, a1 = np.asarray(rows["entropy_target"], dtype=np.float64)[0, m], np.asarray(rows["alpha_rs"])[0, m]
    out["entropy_slope_rs"] = float(np.polyfit(h, a1, 1)[0]) if m.sum() >= 2 and np.ptp(h) > 0 else float("nan")
    out["num_positions"] = int(m.sum())
    return out


def position_columns(rows: dict, gamma: int) -> dict:
    """Per-position vectors from which every statistic of :func:`point_metrics` is a weighted
    sum: ``name -> (numerator, denominator)`` for the means, and ``_slope``: the moments of the slope."""
    chain = np.asarray(rows["chain"], dtype=bool)
    cols = {}
    K = chain.shape[0]
    for name in ("alpha_rs", "alpha_to"):
        a = np.asarray(rows[name], dtype=np.float64)
        for k in range(K):
            cols[f"{name}_step{k + 1}"] = (np.where(chain[k], a[k], 0.0), chain[k].astype(np.float64))
        full = chain[gamma - 1]
        accept_len = np.cumsum(np.cumprod(a[:gamma], axis=0), axis=0)[gamma - 1]
        cols[f"accept_len_{name[-2:]}_g{gamma}"] = (np.where(full, accept_len, 0.0), full.astype(np.float64))
    m = chain[0].astype(np.float64)
    h = np.where(chain[0], np.asarray(rows["entropy_target"], dtype=np.float64)[0], 0.0)
    y = np.where(chain[0], np.asarray(rows["alpha_rs"], dtype=np.float64)[0], 0.0)
    cols[SLOPE] = np.stack([m, h, y, h * h, h * y])
    return cols


def weighted_metrics(cols: dict, w: np.ndarray) -> dict[str, float]:
    """The statistics of a resample given as multiplicities ``w`` of the columns' units
    (positions for :func:`position_columns`, texts for :func:`text_columns`)."""
    out = {}
    for name, value in cols.items():
        if name == SLOPE:
            n, sx, sy, sxx, sxy = value @ w
            var = n * sxx - sx * sx
            out["entropy_slope_rs"] = float((n * sxy - sx * sy) / var) if n >= 2 and var > 1e-12 * max(n * sxx, 1e-300) \
                else float("nan")
        else:
            num, den = value
            d = den @ w
            out[name] = float((num @ w) / d) if d > 0 else float("nan")
    return out


def text_columns(rows: dict, text_ids, num_texts: int, gamma: int, decode: dict | None = None) -> dict:
    """:func:`position_columns` summed per text: ``text_ids`` (int ``[N]``, in ``0..num_texts-1``)
    names the text of every position. ``decode``: optional ``{"rs": (accepted[n], verifications[n]),
    "to": ...}``, the decode-exact sums per text, added as ``accept_len_decode_<mode>_g{gamma}``."""
    ids = np.asarray(text_ids, dtype=np.int64)
    pos = position_columns(rows, gamma)
    if len(ids) != np.asarray(rows["chain"]).shape[1]:
        raise ValueError(f"text_ids has {len(ids)} entries for {np.asarray(rows['chain']).shape[1]} positions")

    def per_text(v):
        return np.bincount(ids, weights=v, minlength=num_texts).astype(np.float64)

    cols = {}
    for name, value in pos.items():
        cols[name] = np.stack([per_text(v) for v in value]) if name == SLOPE else tuple(per_text(v) for v in value)
    for mode, (acc, ver) in (decode or {}).items():
        acc, ver = np.asarray(acc, dtype=np.float64), np.asarray(ver, dtype=np.float64)
        if acc.shape != (num_texts,) or ver.shape != (num_texts,):
            raise ValueError(f"decode sums must be [{num_texts}] per text, got {acc.shape} and {ver.shape}")
        cols[f"accept_len_decode_{mode}_g{gamma}"] = (acc, ver)
    return cols


def metric_names(cols: dict) -> list[str]:
    return ["entropy_slope_rs" if k == SLOPE else k for k in cols]


def _units(cols: dict) -> int:
    value = cols[SLOPE] if SLOPE in cols else next(iter(cols.values()))[0]
    return np.shape(value)[-1]


def _interval(values, level: float = 0.95) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if not len(v):
        return float("nan"), float("nan")
    lo, hi = np.percentile(v, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def _t_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with an integer ``df`` >= 1: the finite series of Abramowitz and
    Stegun 26.7.3-4 in theta = atan(t / sqrt(df))."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    term = acc = c if df % 2 else 1.0
    for k in range(3 if df % 2 else 2, df - 1, 2):
        term *= (k - 1) / k * c * c
        acc += term
    if df % 2:
        return 2 / math.pi * (theta + (s * acc if df > 1 else 0.0))
    return s * acc


@functools.lru_cache(maxsize=256)
def t_quantile(level: float, df: int) -> float:
    """The two-sided ``level`` quantile of Student's t with ``df`` degrees of freedom (0.95, 2:
    4.303): the t with P(|T| < t) = level, by bisection on :func:`_t_two_sided`."""
    if int(df) != df or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, int(df)) < level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_two_sided(mid, int(df)) < level else (lo, mid)
    return (lo + hi) / 2


def t_interval(values, level: float = 0.95):
    """``(mean, low, high)`` over the last axis (the seeds): mean +- t(S-1) * sd / sqrt(S), sd with
    S - 1 in the denominator. Vectorized over leading axes; NaN where S < 2 or a value is NaN."""
    v = np.asarray(values, dtype=np.float64)
    S = v.shape[-1]
    mean = v.mean(axis=-1) if S else np.full(v.shape[:-1], np.nan)
    if S < 2:
        nan = np.full(np.shape(mean), np.nan)
        out = (mean, nan, nan.copy())
    else:
        half = t_quantile(level, S - 1) * v.std(axis=-1, ddof=1) / math.sqrt(S)
        out = (mean, mean - half, mean + half)
    return tuple(float(x) for x in out) if v.ndim == 1 else out


def _weighted_many(cols: dict, W: np.ndarray, names) -> dict[str, np.ndarray]:
    """:func:`weighted_metrics` of many resamples at once: ``W`` ``[units, B]`` -> ``name -> [B]``."""
    out = {}
    for name in names:
        if name == "entropy_slope_rs":
            n, sx, sy, sxx, sxy = cols[SLOPE] @ W
            var = n * sxx - sx * sx
            ok = (n >= 2) & (var > 1e-12 * np.maximum(n * sxx, 1e-300))
            with np.errstate(divide="ignore", invalid="ignore"):
                out[name] = np.where(ok, (n * sxy - sx * sy) / np.where(ok, var, 1.0), np.nan)
        else:
            num, den = cols[name]
            d = den @ W
            with np.errstate(divide="ignore", invalid="ignore"):
                out[name] = np.where(d > 0, (num @ W) / np.where(d > 0, d, 1.0), np.nan)
    return out


def _check_runs(cols_a: list[dict], cols_b: list[dict] | None) -> int:
    if not cols_a:
        raise ValueError("no seeds")
    if cols_b is not None and len(cols_b) != len(cols_a):
        raise ValueError(f"paired runs need the same seeds: {len(cols_a)} and {len(cols_b)}")
    n = _units(cols_a[0])
    for c in [*cols_a, *(cols_b or [])]:
        if _units(c) != n:
            raise ValueError("every run must be evaluated on the same held-out texts")
    return n


def _per_seed(cols_a: list[dict], cols_b: list[dict] | None, names, W: np.ndarray) -> dict[str, np.ndarray]:
    """``name -> [S, B]``: per seed, ``a - b`` (or ``a``) of each resample's texts ``W`` ``[n, B]``."""
    out = {k: [] for k in names}
    for s in range(len(cols_a)):
        ma = _weighted_many(cols_a[s], W, names)
        mb = _weighted_many(cols_b[s], W, names) if cols_b is not None else None
        for k in names:
            out[k].append(ma[k] - (mb[k] if mb is not None else 0.0))
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def seed_values(cols_a: list[dict], cols_b: list[dict] | None = None, names=None) -> dict[str, np.ndarray]:
    """``name -> [S]``: per seed, the statistic of ``a`` (minus ``b``'s: the paired difference)
    over every held-out text. ``cols_a`` / ``cols_b``: one :func:`text_columns` per seed, the
    same seeds in the same order, the same texts."""
    n = _check_runs(cols_a, cols_b)
    names = list(names) if names is not None else metric_names(cols_a[0])
    return {k: v[:, 0] for k, v in _per_seed(cols_a, cols_b, names, np.ones((n, 1))).items()}


def _text_draws(rng, n: int, num_boot: int) -> np.ndarray:
    """``[n, num_boot]``: the multiplicities of the texts in each resample, drawn as
    ``rng.integers(0, n, n)`` per resample, in order (one ``[num_boot, n]`` draw: the same stream)."""
    picks = rng.integers(0, n, (num_boot, n))
    flat = (picks + n * np.arange(num_boot)[:, None]).ravel()
    return np.bincount(flat, minlength=num_boot * n).reshape(num_boot, n).T.astype(np.float64)


def paired_bootstrap(cols_a: list[dict], cols_b: list[dict] | None, names=None, num_boot: int = 1000,
                     seed: int = 0, level: float = 0.95) -> dict[str, tuple[float, float, float]]:
    """``name -> (value, low, high)``, **responses only**: the mean over seeds of ``a - b`` (or of
    ``a`` when ``cols_b`` is None) and its percentile interval over resamples of the held-out
    texts (``rng.integers(0, n, n)`` per resample), every seed kept: one draw of texts for all
    seeds and both objectives (paired). The seeds' spread is not in it (:func:`t_interval`)."""
    n = _check_runs(cols_a, cols_b)
    names = list(names) if names is not None else metric_names(cols_a[0])
    rng = np.random.default_rng(seed)
    W = _text_draws(rng, n, num_boot)
    point = seed_values(cols_a, cols_b, names)
    samples = _per_seed(cols_a, cols_b, names, W)
    return {k: (float(point[k].mean()), *_interval(samples[k].mean(axis=0), level)) for k in names}


def response_bootstrap(cols: list[dict], names=None, num_boot: int = 1000, seed: int = 0):
    """``name -> (value, low, high)`` of one objective's runs (one :func:`text_columns` per seed),
    responses only (:func:`paired_bootstrap`)."""
    return paired_bootstrap(cols, None, names, num_boot, seed)


def hierarchical_bootstrap(cols_a: list[dict], cols_b: list[dict] | None, names=None, num_boot: int = 1000,
                           seed: int = 0, level: float = 0.95) -> dict[str, tuple[float, float, float]]:
    """``name -> (value, low, high)``: seeds outer, texts inner (module docstring). The value is
    the mean over seeds (as :func:`t_interval`'s); the interval value +- t(S-1) * sqrt(S/(S-1)) *
    the resamples' standard deviation. NaN with one seed (no seed-level interval)."""
    n = _check_runs(cols_a, cols_b)
    names = list(names) if names is not None else metric_names(cols_a[0])
    S = len(cols_a)
    point = seed_values(cols_a, cols_b, names)
    if S < 2 or num_boot < 2:
        return {k: (float(point[k].mean()), float("nan"), float("nan")) for k in names}
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, S, (num_boot, S))  # every resample's seeds, then every resample's texts
    W = _text_draws(rng, n, num_boot)
    per_seed = _per_seed(cols_a, cols_b, names, W)  # [S, B]
    scale = t_quantile(level, S - 1) * math.sqrt(S / (S - 1))
    out = {}
    for k in names:
        samples = np.take_along_axis(per_seed[k], picks.T, axis=0).mean(axis=0)
        samples = samples[np.isfinite(samples)]
        value = float(point[k].mean())
        half = scale * float(samples.std(ddof=1)) if len(samples) > 1 else float("nan")
        out[k] = (value, value - half, value + half)
    return out


def seed_intervals(cols_a: list[dict], cols_b: list[dict] | None = None, names=None, num_boot: int = 1000,
                   seed: int = 0, level: float = 0.95) -> dict[str, dict]:
    """Every interval of the study for each name: ``{"value", "per_seed" [S], "t" (lo, hi),
    "hierarchical" (lo, hi), "responses" (lo, hi)}``: the report's cells."""
    names = list(names) if names is not None else metric_names(cols_a[0])
    per_seed = seed_values(cols_a, cols_b, names)
    hier = hierarchical_bootstrap(cols_a, cols_b, names, num_boot, seed, level)
    resp = paired_bootstrap(cols_a, cols_b, names, num_boot, seed, level)
    out = {}
    for k in names:
        value, lo, hi = t_interval(per_seed[k], level)
        out[k] = {"value": value, "per_seed": [float(x) for x in per_seed[k]], "t": (lo, hi),
                  "hierarchical": hier[k][1:], "responses": resp[k][1:]}
    return out


def position_bootstrap(rows: dict, gamma: int, num_boot: int = 1000, seed: int = 0):
    """The older intervals over positions (positions resampled, as if independent): kept to show
    how much narrower they are than :func:`response_bootstrap`'s."""
    cols = position_columns({k: np.asarray(v) for k, v in rows.items()}, gamma)
    n = _units(cols)
    return paired_bootstrap([cols], None, None, num_boot, seed) if n else {}


__all__ = ["hierarchical_bootstrap", "paired_bootstrap", "point_metrics", "position_bootstrap", "position_columns",
           "response_bootstrap", "seed_intervals", "seed_values", "t_interval", "t_quantile", "text_columns",
           "weighted_metrics"]
