"""Held-out statistics of a trained head and their 95% intervals over responses (and seeds).

Legend: K MTP steps, G gamma, N positions, n texts (held-out responses), S seeds.

Input: per-position rows (``{"chain", "alpha_rs", "alpha_to", "entropy_target": [K, N]}``,
what ``tools/eval_acceptance.py --positions-out`` and :func:`bebop_megatron.study.runs.held_out_rows`
keep) with the text (response) of every position, and optionally the decode-exact sums per text
(:mod:`bebop_megatron.losses.decode_exact`: expected accepted drafts and verifications).

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

Intervals (:func:`response_bootstrap`, :func:`paired_bootstrap`): percentile bootstrap, 1000
resamples, a fixed seed. One resample draws, in this order, S seeds with replacement
(``rng.integers(0, S, S)``, only when S > 1) and n texts with replacement
(``rng.integers(0, n, n)``); the statistic of the resample is the mean over the drawn seeds of
each seed's statistic over the drawn texts (the held-out texts are the same for every seed and
objective, so one draw of texts serves all of them: the differences are paired). Positions of
one response are correlated, so resampling positions (:func:`position_bootstrap`, the older
tables') gives intervals that are too narrow.
"""

from __future__ import annotations

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


def _resamples(num_seeds: int, num_texts: int, num_boot: int, seed: int):
    """``(seed indices, text multiplicities)`` per resample, in the order the module docstring states."""
    rng = np.random.default_rng(seed)
    for _ in range(num_boot):
        seeds = rng.integers(0, num_seeds, num_seeds) if num_seeds > 1 else np.zeros(1, dtype=np.int64)
        w = np.bincount(rng.integers(0, num_texts, num_texts), minlength=num_texts).astype(np.float64)
        yield seeds, w


def paired_bootstrap(cols_a: list[dict], cols_b: list[dict] | None, names=None, num_boot: int = 1000,
                     seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """``name -> (value, low, high)``: the mean over seeds of ``a - b`` (or of ``a`` when
    ``cols_b`` is None) and its percentile 95% interval over responses and seeds.

    ``cols_a`` / ``cols_b``: one :func:`text_columns` per seed, the same texts in the same order."""
    if not cols_a:
        raise ValueError("no seeds")
    if cols_b is not None and len(cols_b) != len(cols_a):
        raise ValueError(f"paired runs need the same seeds: {len(cols_a)} and {len(cols_b)}")
    n = _units(cols_a[0])
    for c in [*cols_a, *(cols_b or [])]:
        if _units(c) != n:
            raise ValueError("every run must be evaluated on the same held-out texts")
    names = list(names) if names is not None else metric_names(cols_a[0])
    ones = np.ones(n)

    def stat(seeds, w):
        per_seed = []
        for s in seeds:
            ma = weighted_metrics(cols_a[s], w)
            mb = weighted_metrics(cols_b[s], w) if cols_b is not None else None
            per_seed.append([ma[k] - (mb[k] if mb is not None else 0.0) for k in names])
        return np.mean(np.asarray(per_seed, dtype=np.float64), axis=0)

    point = stat(range(len(cols_a)), ones)
    samples = np.asarray([stat(s, w) for s, w in _resamples(len(cols_a), n, num_boot, seed)])
    return {k: (float(point[i]), *_interval(samples[:, i])) for i, k in enumerate(names)}


def response_bootstrap(cols: list[dict], names=None, num_boot: int = 1000, seed: int = 0):
    """``name -> (value, low, high)`` of one run (one :func:`text_columns` per seed)."""
    return paired_bootstrap(cols, None, names, num_boot, seed)


def position_bootstrap(rows: dict, gamma: int, num_boot: int = 1000, seed: int = 0):
    """The older intervals over positions (positions resampled, as if independent): kept to show
    how much narrower they are than :func:`response_bootstrap`'s."""
    cols = position_columns({k: np.asarray(v) for k, v in rows.items()}, gamma)
    n = _units(cols)
    return paired_bootstrap([cols], None, None, num_boot, seed) if n else {}


__all__ = ["paired_bootstrap", "point_metrics", "position_bootstrap", "position_columns", "response_bootstrap",
           "text_columns", "weighted_metrics"]
