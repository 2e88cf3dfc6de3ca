"""PNG plots of an acceptance report (matplotlib, Agg backend: no display needed).

Each function takes the ``per_temperature`` dict of :meth:`AcceptanceReport.summary` and
writes one file; :func:`write_all` writes them all and returns ``{name: path}``.
"""

from __future__ import annotations

import os

import numpy as np

PLOTS = ("alpha_per_step", "accept_len_vs_gamma", "acceptance_vs_entropy", "accept_len_vs_temperature",
         "rs_vs_to_boundary", "acceptance_by_position")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str) -> None:
    """Write ``fig`` to ``path`` as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def _none_to_nan(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def alpha_per_step(per_t: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (tau, e) in enumerate(per_t.items()):
        steps = np.arange(1, len(e["alpha_rs"]) + 1)
        color = f"C{i}"
        ax.plot(steps, e["alpha_rs"], "o-", color=color, label=f"RS, T={tau}")
        ax.plot(steps, e["alpha_to"], "s--", color=color, label=f"target-only, T={tau}")
    ax.set_xlabel("MTP step k")
    ax.set_ylabel("acceptance")
    ax.set_title("per-step acceptance: alpha_RS = sum min(p, q), alpha_TO = p(argmax q)", fontsize=9)
    ax.set_xticks(steps)
    ax.legend(fontsize=7, ncol=2)
    save(fig, path)


def accept_len_vs_gamma(per_t: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (tau, e) in enumerate(per_t.items()):
        gammas = np.arange(1, len(e["accept_len_rs"]) + 1)
        color = f"C{i}"
        ax.plot(gammas, e["accept_len_rs"], "-", color=color, label=f"RS Eq. 12 over positions, T={tau}")
        ax.plot(gammas, e["accept_len_to"], "--", color=color, label=f"TO Eq. 12 over positions, T={tau}")
        if "accept_len_decode_rs" in e:
            exact = "decode-exact" if e.get("decode_exact") else "decode forecast (approx.)"
            ax.plot(gammas, _none_to_nan(e["accept_len_decode_rs"]), "D-", color=color, lw=2,
                    label=f"RS {exact}, T={tau}")
            ax.plot(gammas, _none_to_nan(e["accept_len_decode_to"]), "D:", color=color, lw=2)
        if e["num_simulated_chains"]:
            ax.plot(gammas, _none_to_nan(e["empirical_accept_len_rs"]), "o", color=color, mfc="none",
                    label=f"RS simulated ({e['num_simulated_chains']} chains)")
            ax.plot(gammas, _none_to_nan(e["empirical_accept_len_to"]), "s", color=color, mfc="none")
    ax.set_xlabel("gamma (drafted tokens)")
    ax.set_ylabel("expected accepted drafts E[L]")
    ax.set_xticks(gammas)
    ax.legend(fontsize=7, ncol=2)
    save(fig, path)


def acceptance_vs_entropy(per_t: dict, tau: str, path: str) -> None:
    """Fig. 1a / Fig. 8: binned acceptance against H(p) with the fitted lines (all steps pooled)."""
    plt = pyplot()
    e = per_t[tau]
    bins = e["entropy_bins"]
    edges = np.array(bins["edges"])
    centers = 0.5 * (edges[1:] + edges[:-1])
    fig, ax = plt.subplots(figsize=(6, 4))
    for which, marker, color in (("rs", "o", "C0"), ("to", "s", "C1")):
        means = _none_to_nan(bins[f"alpha_{which}"])
        ax.plot(centers, means, marker, color=color, label=f"{which.upper()} binned mean")
        fit = e["entropy_fit"][which]
        if fit["slope"] is not None:
            filled = np.flatnonzero(np.isfinite(means))  # draw the line across the non-empty bins
            xs = edges[[filled[0], filled[-1] + 1]] if len(filled) else edges[[0, -1]]
            ax.plot(xs, fit["intercept"] + fit["slope"] * xs, "-", color=color,
                    label=f"{which.upper()} fit: slope {fit['slope']:+.3f}")
    ax.set_xlabel("target entropy H(p) (nats)")
    ax.set_ylabel("acceptance")
    ax.set_title(f"acceptance against entropy, T={tau}", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path)


def accept_len_vs_temperature(per_t: dict, path: str) -> None:
    """Fig. 12a: E[L](gamma) at the largest gamma against the temperature."""
    plt = pyplot()
    taus = np.array([float(t) for t in per_t])
    fig, ax = plt.subplots(figsize=(6, 4))
    for which, marker, color in (("rs", "o", "C0"), ("to", "s", "C1")):
        ax.plot(taus, [e[f"accept_len_{which}"][-1] for e in per_t.values()], marker + "-", color=color,
                label=f"{which.upper()} analytic")
        sim = [e[f"empirical_accept_len_{which}"][-1] for e in per_t.values()]
        if any(v is not None for v in sim):
            ax.plot(taus, _none_to_nan(sim), marker, color=color, mfc="none", ms=10, label=f"{which.upper()} simulated")
    gamma = len(next(iter(per_t.values()))["accept_len_rs"])
    ax.set_xlabel("temperature T (both logits divided by T)")
    ax.set_ylabel(f"E[L] at gamma={gamma}")
    ax.legend(fontsize=8)
    save(fig, path)


def rs_vs_to_boundary(per_t: dict, scatter: list, tau: str, path: str) -> None:
    """Fig. 13: RS beats target-only where d_TV(p, q) < 1 - p(argmax q) (above the diagonal)."""
    plt = pyplot()
    e = per_t[tau]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    if scatter:
        pts = np.array(scatter)
        sc = left.scatter(pts[:, 2], pts[:, 3], c=pts[:, 1], s=6, cmap="viridis")
        fig.colorbar(sc, ax=left, label="H(p)")
    left.plot([0, 1], [0, 1], "k--", lw=1, label="d_TV = 1 - p(argmax q)")
    left.set_xlabel("d_TV(p, q)  (RS rejection)")
    left.set_ylabel("1 - p(argmax q)  (target-only rejection)")
    left.set_title("above the diagonal: RS accepts more", fontsize=9)
    left.legend(fontsize=8, loc="lower right")
    bins = e["entropy_bins"]
    edges = np.array(bins["edges"])
    centers = 0.5 * (edges[1:] + edges[:-1])
    for k, fractions in enumerate(bins["rs_win_fraction_per_step"], start=1):
        right.plot(centers, _none_to_nan(fractions), "o-", label=f"step {k}")
    right.set_ylim(-0.05, 1.05)
    right.set_xlabel("target entropy H(p) (nats)")
    right.set_ylabel("fraction of positions where RS wins")
    right.legend(fontsize=8)
    fig.suptitle(f"RS vs target-only, T={tau}", fontsize=10)
    save(fig, path)


def speedup_vs_gamma(speedup: dict, path: str) -> None:
    """Expected speed-up against gamma per temperature (:mod:`bebop_megatron.metrics.speedup`),
    the recommended gamma marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (tau, row) in enumerate(speedup["per_temperature"].items()):
        color = f"C{i}"
        gammas = np.array(row["gamma"])
        ax.plot(gammas, row["speedup_rs"], "o-", color=color, label=f"RS, T={tau}")
        ax.plot(gammas, row["speedup_to"], "s--", color=color, mfc="none", label=f"target-only, T={tau}")
        if row["best_gamma_rs"]:
            ax.plot([row["best_gamma_rs"]], [row["best_speedup_rs"]], "*", color=color, ms=16,
                    label=f"recommended gamma {row['best_gamma_rs']}, T={tau}")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    c = speedup["costs"]
    ax.set_xlabel("gamma (drafted tokens)")
    ax.set_ylabel("expected speed-up over plain decoding")
    ax.set_xticks(gammas)
    ax.set_title(f"(1 + E[L]) / (1 + gamma c_draft/c_target + overhead); c_draft/c_target {c['draft_ratio']:.3f} "
                 f"({c['source']})", fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    save(fig, path)


def acceptance_by_position(per_t: dict, path: str) -> None:
    """alpha_RS per step and the decode-exact E[L] of RS by context-position bucket."""
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (tau, e) in enumerate(per_t.items()):
        b = e["by_position"]
        x = np.arange(len(b["buckets"]))
        for k, alpha in enumerate(b["alpha_rs"]):
            ax.plot(x, _none_to_nan(alpha), "o-", color=f"C{i}", alpha=1.0 - 0.5 * k / max(len(b["alpha_rs"]), 1),
                    label=f"T={tau}, step {k + 1}")
        ax2.plot(x, _none_to_nan(b["accept_len_decode_rs"]), "D-", color=f"C{i}", label=f"T={tau}")
    for a, ylabel in ((ax, "alpha_RS"), (ax2, "decode-exact E[L] (RS, gamma = all steps)")):
        a.set_xticks(x)
        a.set_xticklabels([f"{n}\n({int(c)})" for n, c in zip(b["buckets"], b["count"])], fontsize=7)
        a.set_xlabel("context position (positions)")
        a.set_ylabel(ylabel)
        a.legend(fontsize=7)
    save(fig, path)


def write_all(per_t: dict, scatter: list, tau: str, out_dir: str, speedup: dict | None = None) -> dict[str, str]:
    """Every plot; ``speedup_vs_gamma`` too when ``speedup`` (:func:`speedup_table`) is given."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, f"{name}.png") for name in PLOTS}
    if speedup is not None:
        paths["speedup_vs_gamma"] = os.path.join(out_dir, "speedup_vs_gamma.png")
        speedup_vs_gamma(speedup, paths["speedup_vs_gamma"])
    alpha_per_step(per_t, paths["alpha_per_step"])
    accept_len_vs_gamma(per_t, paths["accept_len_vs_gamma"])
    acceptance_vs_entropy(per_t, tau, paths["acceptance_vs_entropy"])
    accept_len_vs_temperature(per_t, paths["accept_len_vs_temperature"])
    rs_vs_to_boundary(per_t, scatter, tau, paths["rs_vs_to_boundary"])
    acceptance_by_position(per_t, paths["acceptance_by_position"])
    return paths
