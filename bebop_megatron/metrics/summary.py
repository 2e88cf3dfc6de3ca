"""The console summary of an acceptance report (``tools/eval_acceptance.py``'s result dict)."""

from __future__ import annotations

import os


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def _decode(e: dict, which: str) -> str:
    value = e.get(f"accept_len_decode_{which}", [None])[-1]
    if value is None:
        return "n/a"
    lo, hi = e[f"accept_len_decode_{which}_ci95"][-1]
    return f"{value:.3f}" + ("" if lo is None else f" [{lo:.3f}, {hi:.3f}]")


def summary_lines(result: dict) -> list[str]:
    """Per temperature: alpha_RS / alpha_TO per step, E[L](gamma) (decode-exact forecast, Eq. 12
    over every position and simulated) and the entropy slopes; the speed-up model and its
    recommended gamma with the E[L] it used; where the report was written."""
    lines = []
    for tau, e in result["per_temperature"].items():
        rs = " ".join(f"{a:.3f}" for a in e["alpha_rs"])
        to = " ".join(f"{a:.3f}" for a in e["alpha_to"])
        sim = e["empirical_accept_len_rs"][-1]
        exact = "decode-exact" if e.get("decode_exact") else "decode-exact forecast (text not sampled from this " \
                                                             "backbone at T: approximate)"
        lines.append(f"T={tau}: alpha_RS [{rs}] alpha_TO [{to}] | E[L]({result['gamma']}) {exact} "
                     f"RS {_decode(e, 'rs')} "
                     f"TO {_decode(e, 'to')}; Eq. 12 over every position RS {e['accept_len_rs'][-1]:.3f} (simulated "
                     f"{'n/a' if sim is None else f'{sim:.3f}'}) TO {e['accept_len_to'][-1]:.3f} | entropy slope RS "
                     f"{_fmt(e['entropy_fit']['rs']['slope'])} TO {_fmt(e['entropy_fit']['to']['slope'])}")
    speedup = result.get("speedup")
    if speedup:
        c = speedup["costs"]
        times = (f"c_target {c['target_ms']:.3f} ms, c_draft {c['draft_ms']:.3f} ms, " if c["target_ms"] else "")
        lines.append(f"speed-up model ({c['source']}): {times}c_draft/c_target {c['draft_ratio']:.3f}, overhead "
                     f"{c['overhead']:.3f}; {speedup['note']}")
        for tau, row in speedup["per_temperature"].items():
            rs = " ".join(f"{g}:{s:.2f}" for g, s in zip(row["gamma"], row["speedup_rs"]))
            lines.append(f"T={tau}: speed-up RS by gamma [{rs}] -> recommended gamma {row['best_gamma_rs']} "
                         f"({row['best_speedup_rs']:.2f}x; target-only best {row['best_gamma_to']}: "
                         f"{row['best_speedup_to']:.2f}x) from the {row['accept_len_used']} E[L]")
    lines.append(f"wrote {os.path.join(os.path.dirname(result['plots']['alpha_per_step']), 'report.json')} and "
                 f"{len(result['plots'])} plots")
    return lines
