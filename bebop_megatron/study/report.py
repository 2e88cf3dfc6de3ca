"""The objective study's report: RESULTS.md, CSV rows and one PNG of learning curves per condition.

Read from the work directory's finished runs (:mod:`bebop_megatron.study.runs`), so the report
can be written again at any time, of a finished or a partial study. Intervals:
:mod:`bebop_megatron.study.intervals` (bootstrap over held-out responses and, with several
seeds, over seeds).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from bebop_megatron.study.intervals import paired_bootstrap, text_columns
from bebop_megatron.study.log import log
from bebop_megatron.study.runs import is_finished, load_rows, read_record, write_json

REFERENCES = ("ce", "kl")


def _tau_key(tau: float) -> str:
    return f"{tau:g}"


def metric_list(K: int, gamma: int) -> list[tuple[str, str]]:
    return [*((f"alpha_rs_step{k}", f"alpha_RS step {k}") for k in range(1, K + 1)),
            (f"accept_len_rs_g{gamma}", f"E[L]({gamma}) Eq. 12"),
            (f"accept_len_decode_rs_g{gamma}", f"E[L]({gamma}) decode-exact"),
            ("entropy_slope_rs", "slope alpha_RS vs H(p)")]


def collect(plan) -> dict:
    """``{condition: {objective: {seed: (record, rows)}}}`` of the finished runs."""
    from bebop_megatron.study.driver import ordered_objectives, run_folder

    out: dict = {}
    for condition in plan.conditions:
        for objective in ordered_objectives(plan.objectives):
            for seed in plan.seeds:
                folder = run_folder(plan, condition, objective, seed)
                if is_finished(folder):
                    out.setdefault(condition, {}).setdefault(objective, {})[seed] = (read_record(folder),
                                                                                     load_rows(folder / "rows.npz"))
    return out


def columns_of(rows: dict, tau: str, gamma: int) -> dict:
    r = rows[tau]
    decode = {mode: (r[f"decode_{mode}"][:, 0], r[f"decode_{mode}"][:, 1]) for mode in ("rs", "to")}
    return text_columns(r, r["text"], len(r["decode_rs"]), gamma, decode)


def fmt(v, digits: int = 3, signed: bool = False) -> str:
    value, lo, hi = v
    if not np.isfinite(value):
        return "n/a"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    return f"{f.format(value)} [{f.format(lo)}, {f.format(hi)}]"


def recommendation(condition: str, stats: dict, diffs: dict, key: str, label: str, size: str) -> str:
    """One line: the leader by ``key`` and whether the intervals separate it from each other objective."""
    ranked = sorted(stats, key=lambda o: -stats[o][key][0] if np.isfinite(stats[o][key][0]) else math.inf)
    if len(ranked) < 2:
        return f"- {condition}: one objective only ({ranked[0] if ranked else 'none'}); nothing to compare."
    leader = ranked[0]
    close = [o for o in ranked[1:] if not diffs[(leader, o)][key][1] > 0]
    if not close:
        return (f"- {condition}: **{leader}** leads on {label} at T=1 ({fmt(stats[leader][key])}); the 95% interval "
                f"of its paired difference excludes 0 against every other objective ({size}).")
    return (f"- {condition}: the intervals do not separate the leaders: {leader} ({fmt(stats[leader][key])}) and "
            + ", ".join(f"{o} (difference {fmt(diffs[(leader, o)][key], signed=True)})" for o in close)
            + f" on {label} at T=1; no winner at this size ({size}).")


def machine_lines(plan, found: dict) -> list[str]:
    """The machines the finished runs were made on, when the work folder holds a
    ``provenance.jsonl`` (a study carried by ``--pack``/``--unpack``; docs/study.md): one line if
    all were made on one machine, else a line per machine with its runs. A run that no unpack
    brought was made in this work folder, on this machine. Without the file: no line."""
    from bebop_megatron.study.pack import PROVENANCE, describe, machine, run_machines

    if not (Path(plan.work) / PROVENANCE).is_file():
        return []
    names = [f"{c}/{o}/seed{s}" for c, per_obj in found.items() for o, seeds in per_obj.items() for s in seeds]
    if not names:
        return []
    here = None
    groups: dict = {}
    for name, m in run_machines(plan.work, names).items():
        if m is None:
            here = here or machine()
            m = here
        groups.setdefault(describe(m), []).append(name)
    if len(groups) == 1:
        return [f"Machine: every run on {next(iter(groups))} (WORK/{PROVENANCE}: the study was carried by "
                "--pack/--unpack).", ""]
    return [f"Machines the runs were made on (WORK/{PROVENANCE}: the study was carried by --pack/--unpack):", "",
            *(f"- {m}: {', '.join(runs)}" for m, runs in groups.items()), ""]


def write_report(plan, *, num_boot: int = 1000) -> dict:
    """RESULTS.md, results.csv, curves_<condition>.png and summary.json in ``plan.out``."""
    import json

    found = collect(plan)
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    G = plan.gamma
    taus = [_tau_key(t) for t in plan.temperatures]
    # the runs' own token counts (a report of runs made with other settings states theirs)
    run_tokens = sorted({rec["tokens"] for per_obj in found.values() for seeds in per_obj.values()
                         for rec, _ in seeds.values()}) or [plan.steps * plan.tokens_per_step]
    tokens = "/".join(f"{t:,}" for t in run_tokens)
    tokens_csv = run_tokens[0] if len(run_tokens) == 1 else "/".join(str(t) for t in run_tokens)
    lines = [f"# Objective study{': ' + plan.title if plan.title else ''}", "",
             f"{tokens} training tokens per run, seeds {plan.seeds}, "
             f"device {plan.device} ({plan.precision}); gamma {G}. Values: mean over seeds; 95% intervals: "
             "percentile bootstrap over held-out responses" + (" and seeds" if len(plan.seeds) > 1 else "")
             + f" ({num_boot} resamples; docs/study.md). `E[L] Eq. 12` averages alpha products over every "
             "position; `decode-exact` is what speculative decoding measures (a verification starts after a "
             "rejection or a bonus token, not at every position).",
             ""]
    machines = machine_lines(plan, found)
    lines += machines
    csv_rows = []
    summary = {"plan": {k: str(v) if isinstance(v, Path) else v for k, v in vars(plan).items()
                        if k not in ("train_files", "valid_files", "work", "out", "meg")}, "conditions": {}}
    recs = []
    for condition, per_obj in found.items():
        objectives = list(per_obj)
        K = np.asarray(next(iter(next(iter(per_obj.values())).values()))[1][taus[0]]["chain"]).shape[0]
        metrics = metric_list(K, G)
        keys = [k for k, _ in metrics]
        lines += [f"## Condition `{condition}`", ""]
        num_texts = None
        stats: dict = {}
        cols: dict = {}
        for tau in taus:
            for o in objectives:
                cols[(o, tau)] = {s: columns_of(rows, tau, G) for s, (_, rows) in per_obj[o].items()}
                num_texts = len(per_obj[o][next(iter(per_obj[o]))][1][tau]["decode_rs"])
                stats[(o, tau)] = paired_bootstrap(list(cols[(o, tau)].values()), None, keys, num_boot)
        size_note = (f"{len(plan.seeds)} seed{'s' if len(plan.seeds) > 1 else ''}, "
                     f"{tokens} tokens per run, {num_texts} held-out responses")
        for tau in taus:
            head = ["objective", "seeds", *[label for _, label in metrics]]
            lines += [f"### T={tau}: held-out acceptance", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for o in objectives:
                lines.append("| " + " | ".join([o, str(len(per_obj[o])), *[fmt(stats[(o, tau)][k]) for k in keys]])
                             + " |")
                for k in keys:
                    v = stats[(o, tau)][k]
                    csv_rows.append({"condition": condition, "objective": o, "versus": "", "temperature": tau,
                                     "seeds": len(per_obj[o]), "tokens_per_run": tokens_csv,
                                     "heldout_responses": num_texts, "metric": k, "value": v[0], "lo": v[1],
                                     "hi": v[2]})
            lines.append("")
        diffs: dict = {}
        diff_keys = ["alpha_rs_step1", f"accept_len_rs_g{G}", f"accept_len_decode_rs_g{G}"]
        for tau in taus:
            for ref in REFERENCES:
                if ref not in per_obj:
                    continue
                lines += [f"### T={tau}: paired difference against {ref} (objective - {ref})", "",
                          "| objective | seeds | " + " | ".join(dict(metrics)[k] for k in diff_keys) + " |",
                          "|" + "---|" * (2 + len(diff_keys))]
                for o in objectives:
                    if o == ref:
                        continue
                    seeds = sorted(set(per_obj[o]) & set(per_obj[ref]))
                    d = paired_bootstrap([cols[(o, tau)][s] for s in seeds], [cols[(ref, tau)][s] for s in seeds],
                                         diff_keys, num_boot)
                    lines.append(f"| {o} | {len(seeds)} | " + " | ".join(fmt(d[k], signed=True) for k in diff_keys)
                                 + " |")
                    for k in diff_keys:
                        csv_rows.append({"condition": condition, "objective": o, "versus": ref, "temperature": tau,
                                         "seeds": len(seeds), "tokens_per_run": tokens_csv,
                                         "heldout_responses": num_texts, "metric": f"diff_{k}", "value": d[k][0],
                                         "lo": d[k][1], "hi": d[k][2]})
                lines.append("")
        # The recommendation: the leader at T=1 by the decode-exact E[L], paired against every other objective.
        key = f"accept_len_decode_rs_g{G}"
        t1 = taus[0]
        for a in objectives:
            for b in objectives:
                if a != b:
                    seeds = sorted(set(per_obj[a]) & set(per_obj[b]))
                    diffs[(a, b)] = paired_bootstrap([cols[(a, t1)][s] for s in seeds],
                                                     [cols[(b, t1)][s] for s in seeds], [key], num_boot)
        rec = recommendation(condition, {o: stats[(o, t1)] for o in objectives}, diffs, key,
                             f"the decode-exact E[L]({G})", size_note)
        recs.append(rec)
        lines += ["### Recommendation", "", rec, ""]
        png = curves_png(per_obj, out / f"curves_{condition}.png", f"{plan.title or 'study'}: {condition}", G)
        if png:
            lines += [f"Learning curves: `{png.name}` (the trainer's held-out pass; mean over seeds).", ""]
        summary["conditions"][condition] = {
            "objectives": objectives, "heldout_responses": num_texts,
            "stats": {f"{o}|{tau}": stats[(o, tau)] for o in objectives for tau in taus},
            "runs": {o: {str(s): {k: v for k, v in rec_.items()} for s, (rec_, _) in per_obj[o].items()}
                     for o in objectives}}
    if not found:
        lines.append("No finished run yet.")
    else:
        at = 4 + len(machines)  # after the settings paragraph and the machines' lines
        lines[at:at] = ["Recommendation per condition:", "", *recs, ""]
    # "E[L](3)" would be a Markdown link: escaped in the file (the log keeps it plain).
    (out / "RESULTS.md").write_text("\n".join(lines).replace("E[L](", "E[L]\\(") + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        fields = ["condition", "objective", "versus", "temperature", "seeds", "tokens_per_run", "heldout_responses",
                  "metric", "value", "lo", "hi"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(csv_rows)
    write_json(out / "summary.json", json.loads(json.dumps(summary, default=str)))
    log(f"report: {out / 'RESULTS.md'}, {out / 'results.csv'}")
    for rec in recs:
        log("recommendation " + rec[2:])
    return summary


def curves_png(per_obj: dict, path: Path, title: str, gamma: int) -> Path | None:
    """alpha_RS step 1 and the decode-exact E[L](gamma) of the trainer's held-out pass against
    training tokens, one line per objective (the mean over its seeds)."""
    try:
        from bebop_megatron.metrics.plots import pyplot, save

        plt = pyplot()
    except ImportError:
        log("report: matplotlib is not installed; no curves PNG")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("alpha_rs", 0, "held-out alpha_RS step 1"), ("accept_len_decode_rs", gamma - 1,
                                                               f"held-out decode-exact E[L]({gamma}) RS"))
    for ax, (name, index, label) in zip(axes, panels):
        for objective, seeds in per_obj.items():
            curves = [[(p["tokens"], p[name][index] if len(p.get(name) or []) > index else np.nan)
                       for p in rec["curve"]] for rec, _ in seeds.values()]
            n = min(len(c) for c in curves)
            x = np.asarray([p[0] for p in curves[0][:n]])
            y = np.nanmean(np.asarray([[p[1] for p in c[:n]] for c in curves], dtype=float), axis=0)
            ax.plot(x, y, marker="o", ms=3, label=objective)
        ax.set_xlabel("training tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    save(fig, str(path))
    return path
