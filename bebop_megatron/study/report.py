"""The objective study's report: RESULTS.md, CSV rows and one PNG of learning curves per condition.

Read from the work directory's finished runs (:mod:`bebop_megatron.study.runs`), so the report
can be written again at any time, of a finished or a partial study: it counts the runs that
finished, names the planned runs that did not and the objectives that never ran. Intervals
(:mod:`bebop_megatron.study.intervals`, docs/study.md): the seed is the unit, a paired t-interval
over seeds; beside it the hierarchical bootstrap (seeds, then responses) that checks it and the
response-only interval, labelled. A leader is named only where the t-interval of its paired
difference excludes 0 against every other objective that ran. A decode-exact number at a
temperature other than the held-out text's sampling temperature is labelled approximate and
drives no recommendation.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from bebop_megatron.study.intervals import seed_intervals, text_columns
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


def missing_runs(plan, found: dict) -> list[str]:
    """The planned runs (``condition/objective/seedS``) that have not finished, in the study's order."""
    from bebop_megatron.study.driver import planned_runs

    return [f"{c}/{o}/seed{s}" for c, s, o in planned_runs(plan) if s not in found.get(c, {}).get(o, {})]


def heldout_temperature(plan) -> tuple[float | None, str]:
    """The held-out text's sampling temperature and where it is known from: the responses stage's
    ``WORK/data/responses.json`` (its ``temperature``; a file written before it was recorded: 1,
    the only temperature the stage has sampled at); None when the study read --heldout-data (text
    of unknown origin)."""
    path = Path(plan.work) / "data" / "responses.json"
    if not path.is_file():
        return None, "the held-out text was given (--heldout-data): its sampling temperature is not known"
    heldout = json.loads(path.read_text()).get("heldout") or {}
    return float(heldout.get("temperature", 1.0)), "WORK/data/responses.json, the responses stage"


def text_temperatures(plan, found: dict, taus: list[str]) -> dict[str, float | None]:
    """Each evaluation temperature's held-out text temperature: T itself where every finished run
    was evaluated at T on the held-out answers sampled at T (the responses stage's ``heldout_t0p7`` at 0.7,
    a run's ``own_text_temperatures``), else the T=1 held-out text's (:func:`heldout_temperature`;
    a study whose runs differ here is labelled by the latter: approximate)."""
    base, _ = heldout_temperature(plan)
    records = [rec for per_obj in found.values() for seeds in per_obj.values() for rec, _ in seeds.values()]
    return {tau: float(tau) if records and all(tau in rec.get("own_text_temperatures", ()) for rec in records)
            else base for tau in taus}


def columns_of(rows: dict, tau: str, gamma: int) -> dict:
    r = rows[tau]
    decode = {mode: (r[f"decode_{mode}"][:, 0], r[f"decode_{mode}"][:, 1]) for mode in ("rs", "to")}
    return text_columns(r, r["text"], len(r["decode_rs"]), gamma, decode)


def fmt(v, digits: int = 3, signed: bool = False) -> str:
    """``value [low, high]`` of a ``(value, low, high)`` or of a cell's t-interval; ``value`` alone
    when there is no interval (one seed)."""
    if isinstance(v, dict):
        v = (v["value"], *v["t"])
    value, lo, hi = v
    if not np.isfinite(value):
        return "n/a"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f"{f.format(value)} [n/a]"
    return f"{f.format(value)} [{f.format(lo)}, {f.format(hi)}]"


def fmt_interval(pair, digits: int = 3) -> str:
    lo, hi = pair
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]" if np.isfinite(lo) and np.isfinite(hi) else "n/a"


def per_seed_text(cell, digits: int = 3) -> str:
    return " / ".join(f"{x:+.{digits}f}" for x in cell["per_seed"])


def _names(objs) -> str:
    objs = list(objs)
    return objs[0] if len(objs) == 1 else ", ".join(objs[:-1]) + " and " + objs[-1]


def recommendation(condition: str, tau: str, stats: dict, diffs: dict, key: str, label: str, size: str,
                   not_run=()) -> str:
    """One line at temperature ``tau``: the leader by ``key`` where the seed-level t-interval of its
    paired difference excludes 0 against each other objective that ran (named), else what the
    intervals do not separate. ``stats``: ``{objective: {key: cell}}``; ``diffs``: ``{(a, b): {key:
    cell}}`` over the seeds a and b share (:func:`bebop_megatron.study.intervals.seed_intervals`)."""
    absent = f"; never ran: {_names(not_run)}" if not_run else ""
    ranked = sorted(stats, key=lambda o: -stats[o][key]["value"] if np.isfinite(stats[o][key]["value"]) else math.inf)
    if len(ranked) < 2:
        return (f"- {condition}, T={tau}: one objective only ({ranked[0] if ranked else 'none'}); nothing to compare"
                f"{absent}.")
    leader = ranked[0]
    ahead, close, unresolved, unchecked = [], [], [], []
    for o in ranked[1:]:
        cell = diffs[(leader, o)][key]
        lo, hi = cell["t"]
        if not (np.isfinite(lo) and np.isfinite(hi)):
            shared = len(cell["per_seed"])
            unresolved.append(f"{o} ({shared} seed{'s' if shared != 1 else ''} in common)")
        elif lo > 0:
            ahead.append(f"{o} ({fmt(cell, signed=True)})")
            if not cell["hierarchical"][0] > 0:
                unchecked.append(f"{o} {fmt_interval(cell['hierarchical'])}")
        else:
            close.append(f"{o} (difference {fmt(cell, signed=True)}, per seed {per_seed_text(cell)})")
    note = (f"; the hierarchical bootstrap's check does not exclude 0 against {_names(unchecked)}"
            if unchecked else "")
    if not close and not unresolved:
        return (f"- {condition}, T={tau}: **{leader}** leads on {label} ({fmt(stats[leader][key])}); the seed-level "
                f"95% t-interval of its paired difference excludes 0 against {_names(ahead)}{note} ({size}{absent}).")
    parts = []
    if close:
        parts.append(f"the seed-level intervals do not separate {leader} ({fmt(stats[leader][key])}) from "
                     + _names(close))
    if unresolved:
        parts.append(f"no seed-level interval for {leader} against {_names(unresolved)} (two seeds in common needed)")
    if ahead:
        parts.append(f"it is ahead of {_names(ahead)}{note}")
    return f"- {condition}, T={tau}: no leader on {label}: " + "; ".join(parts) + f" ({size}{absent})."


def approximate_line(condition: str, tau: str, text_tau: float | None, label: str) -> str:
    """The recommendation at a temperature whose decode-exact numbers are approximate."""
    if text_tau is None:
        why = "the held-out text's sampling temperature is not known (--heldout-data)"
    else:
        why = f"no T={tau} text was sampled (the held-out responses are sampled at T={text_tau:g})"
    return (f"- {condition}, T={tau}: no recommendation: {why}, so {label} at T={tau} is approximate (computed on "
            "text of another temperature; docs/study.md) and drives none.")


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


def _size_note(seeds_of: dict, tokens: str, num_texts) -> str:
    counts = sorted({len(s) for s in seeds_of.values()})
    if len(counts) == 1:
        seeds = f"{counts[0]} seed{'s' if counts[0] != 1 else ''}"
    else:
        seeds = "seeds per objective: " + ", ".join(f"{o} {len(s)}" for o, s in seeds_of.items())
    return f"{seeds}, {tokens} tokens per run, {num_texts} held-out responses"


def write_report(plan, *, num_boot: int = 1000) -> dict:
    """RESULTS.md, results.csv, curves_<condition>.png and summary.json in ``plan.out``."""
    found = collect(plan)
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    G = plan.gamma
    taus = [_tau_key(t) for t in plan.temperatures]
    text_tau, text_source = heldout_temperature(plan)
    text_taus = text_temperatures(plan, found, taus)  # per evaluation temperature: its text's
    # exact: the decode-exact number is computed on text sampled at its own temperature
    exact = {tau: text_taus[tau] is not None and math.isclose(float(tau), text_taus[tau]) for tau in taus}
    # with text of unknown temperature, the first temperature's recommendation is given, conditionally
    decides = {tau: exact[tau] or (text_tau is None and tau == taus[0]) for tau in taus}
    own = [tau for tau in taus if text_taus[tau] != text_tau]  # evaluated on text sampled at them
    # the runs' own token counts (a report of runs made with other settings states theirs)
    run_tokens = sorted({rec["tokens"] for per_obj in found.values() for seeds in per_obj.values()
                         for rec, _ in seeds.values()}) or [plan.steps * plan.tokens_per_step]
    tokens = "/".join(f"{t:,}" for t in run_tokens)
    tokens_csv = run_tokens[0] if len(run_tokens) == 1 else "/".join(str(t) for t in run_tokens)
    missing = missing_runs(plan, found)
    finished = sum(len(seeds) for per_obj in found.values() for seeds in per_obj.values())
    ran_seeds = sorted({s for per_obj in found.values() for seeds in per_obj.values() for s in seeds})
    never = [o for o in plan.objectives if not any(o in per_obj for per_obj in found.values())]
    lines = [f"# Objective study{': ' + plan.title if plan.title else ''}", "",
             f"{tokens} training tokens per run, {finished} finished run{'s' if finished != 1 else ''}"
             f" (seeds {', '.join(map(str, ran_seeds)) or 'none'}), device {plan.device} ({plan.precision}); "
             f"gamma {G}. Values: mean over seeds. 95% intervals, the seed as the unit: a paired t-interval over "
             "seeds (Student t, seeds - 1 degrees of freedom; each seed's statistic over every held-out response); "
             "the difference tables add the hierarchical bootstrap that checks it (seeds, then responses; "
             f"{num_boot} resamples; standard error x t quantile x sqrt(S/(S-1))) and the interval over responses "
             "only (seeds fixed: what other prompts would change, not other training seeds). docs/study.md. "
             "`E[L] Eq. 12` averages alpha products over every position; `decode-exact` is what speculative "
             "decoding measures (a verification starts after a rejection or a bonus token, not at every position).",
             "",
             (f"Held-out text: the same held-out prompts answered at each temperature, T={', T='.join(taus)} "
              f"({text_source}): each temperature's decode-exact E[L] is computed on the text sampled at it, "
              "so it is exact at every temperature." if own and all(exact.values()) else
              f"Held-out text: sampled at T={text_tau:g} ({text_source}). The decode-exact E[L] is exact only on "
              "text sampled at its own temperature: "
              + (f"at {', '.join(f'T={t}' for t in taus if not exact[t])} it is approximate (marked ≈) and drives no "
                 "recommendation." if not all(exact.values()) else "here it is, at every temperature.")
              if text_tau is not None else
              f"Held-out text: {text_source}; the decode-exact E[L] is exact only if that text was sampled from this "
              f"model at the temperature of the number: the T={taus[0]} recommendation holds under that condition "
              "(the CSV's `approximate`: unknown), and every other temperature's decode-exact number is marked ≈ "
              "(approximate) and drives no recommendation."),
             ""]
    if missing:
        lines += [f"Partial study: {len(missing)} of the {finished + len(missing)} planned runs have not finished: "
                  + ", ".join(missing) + "." + (f" Never ran: {_names(never)}." if never else ""), ""]
    machines = machine_lines(plan, found)
    lines += machines
    csv_rows = []
    summary = {"plan": {k: str(v) if isinstance(v, Path) else v for k, v in vars(plan).items()
                        if k not in ("train_files", "valid_files", "heldout_files", "work", "out", "meg")},
               "heldout_temperature": text_tau, "text_temperatures": text_taus, "finished_runs": finished,
               "missing_runs": missing,
               "never_ran": never, "conditions": {}}
    recs = []
    key = f"accept_len_decode_rs_g{G}"
    for condition, per_obj in found.items():
        objectives = list(per_obj)
        K = np.asarray(next(iter(next(iter(per_obj.values())).values()))[1][taus[0]]["chain"]).shape[0]
        metrics = metric_list(K, G)
        keys = [k for k, _ in metrics]

        def label_of(k, tau):
            return dict(metrics)[k] + (" ≈ (approximate)" if k.startswith("accept_len_decode") and not decides[tau]
                                       else "")

        lines += [f"## Condition `{condition}`", ""]
        num_texts = None
        stats: dict = {}
        cols: dict = {}
        for tau in taus:
            for o in objectives:
                cols[(o, tau)] = {s: columns_of(rows, tau, G) for s, (_, rows) in per_obj[o].items()}
                num_texts = len(per_obj[o][next(iter(per_obj[o]))][1][tau]["decode_rs"])
                stats[(o, tau)] = seed_intervals(list(cols[(o, tau)].values()), None, keys, num_boot)
        size_note = _size_note({o: per_obj[o] for o in objectives}, tokens, num_texts)
        not_run = [o for o in plan.objectives if o not in per_obj]

        def csv_row(o, versus, tau, seeds, metric, cell):
            decode = metric.removeprefix("diff_").startswith("accept_len_decode")
            csv_rows.append({"condition": condition, "objective": o, "versus": versus, "temperature": tau,
                             "text_temperature": "unknown" if text_taus[tau] is None else f"{text_taus[tau]:g}",
                             "approximate": ("no" if exact[tau] else "unknown" if decides[tau] else "yes")
                             if decode else "",
                             "seeds": len(seeds), "seed_list": "/".join(map(str, seeds)),
                             "tokens_per_run": tokens_csv, "heldout_responses": num_texts, "metric": metric,
                             "value": cell["value"], "lo": cell["t"][0], "hi": cell["t"][1],
                             "hier_lo": cell["hierarchical"][0], "hier_hi": cell["hierarchical"][1],
                             "resp_lo": cell["responses"][0], "resp_hi": cell["responses"][1],
                             "per_seed": "/".join(repr(x) for x in cell["per_seed"])})

        for tau in taus:
            head = ["objective", "seeds", *[label_of(k, tau) for k in keys]]
            lines += [f"### T={tau}: held-out acceptance (t-interval over seeds)", "",
                      "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for o in objectives:
                lines.append("| " + " | ".join([o, str(len(per_obj[o])), *[fmt(stats[(o, tau)][k]) for k in keys]])
                             + " |")
                for k in keys:
                    csv_row(o, "", tau, sorted(per_obj[o]), k, stats[(o, tau)][k])
            lines.append("")
            if not decides[tau]:
                lines += [f"≈ approximate: the decode-exact E[L] at T={tau} is computed on "
                          + (f"text sampled at T={text_taus[tau]:g} (no T={tau} text was sampled)"
                             if text_taus[tau] is not None
                             else "text of unknown temperature") + "; it drives no recommendation.", ""]
        diff_keys = ["alpha_rs_step1", f"accept_len_rs_g{G}", key]
        diffs: dict = {}
        for tau in taus:
            for a in objectives:
                for b in objectives:
                    if a != b:
                        seeds = sorted(set(per_obj[a]) & set(per_obj[b]))
                        diffs[(a, b, tau)] = (seeds, seed_intervals([cols[(a, tau)][s] for s in seeds],
                                                                    [cols[(b, tau)][s] for s in seeds], diff_keys,
                                                                    num_boot) if seeds else None)
            for ref in REFERENCES:
                if ref not in per_obj:
                    continue
                dl = label_of(key, tau)
                lines += [f"### T={tau}: paired difference against {ref} (objective - {ref})", "",
                          f"| objective | seeds | {dl}: per seed | {dl}: t-interval over seeds | hierarchical "
                          f"bootstrap (check) | responses only | {dict(metrics)['alpha_rs_step1']} | "
                          f"{dict(metrics)[f'accept_len_rs_g{G}']} |", "|" + "---|" * 8]
                for o in objectives:
                    if o == ref:
                        continue
                    seeds, d = diffs[(o, ref, tau)]
                    if d is None:
                        lines.append(f"| {o} | 0 | no seed in common | | | | | |")
                        continue
                    c = d[key]
                    lines.append(f"| {o} | {len(seeds)} | {per_seed_text(c)} | {fmt(c, signed=True)} | "
                                 f"{fmt_interval(c['hierarchical'])} | {fmt_interval(c['responses'])} | "
                                 f"{fmt(d['alpha_rs_step1'], signed=True)} | "
                                 f"{fmt(d[f'accept_len_rs_g{G}'], signed=True)} |")
                    for k in diff_keys:
                        csv_row(o, ref, tau, seeds, f"diff_{k}", d[k])
                lines.append("")
        # The recommendation per temperature: the leader by the decode-exact E[L], paired against every
        # other objective that ran; none where the decode-exact number is approximate.
        cond_recs = []
        for tau in taus:
            label = f"the decode-exact E[L]({G}) at T={tau}"
            if not decides[tau]:
                cond_recs.append(approximate_line(condition, tau, text_taus[tau], f"the decode-exact E[L]({G})"))
                continue
            pair = {(a, b): (d[1] if d[1] is not None else {key: {"value": math.nan, "per_seed": [],
                                                                 "t": (math.nan, math.nan),
                                                                 "hierarchical": (math.nan, math.nan)}})
                    for (a, b, t), d in diffs.items() if t == tau}
            rec = recommendation(condition, tau, {o: stats[(o, tau)] for o in objectives}, pair, key, label,
                                 size_note, not_run)
            if text_tau is None:
                rec = rec[:-1] + f"; exact only if the held-out text was sampled from this model at T={tau}."
            cond_recs.append(rec)
        recs += cond_recs
        lines += ["### Recommendation", "", *cond_recs, ""]
        png = curves_png(per_obj, out / f"curves_{condition}.png", f"{plan.title or 'study'}: {condition}", G)
        if png:
            lines += [f"Learning curves: `{png.name}` (the trainer's held-out pass; mean over seeds).", ""]
        summary["conditions"][condition] = {
            "objectives": objectives, "heldout_responses": num_texts, "never_ran": not_run,
            "seeds": {o: sorted(per_obj[o]) for o in objectives}, "recommendations": cond_recs,
            "stats": {f"{o}|{tau}": stats[(o, tau)] for o in objectives for tau in taus},
            "diffs": {f"{a}-{b}|{tau}": d for (a, b, tau), (_, d) in diffs.items() if d is not None},
            "runs": {o: {str(s): {k: v for k, v in rec_.items()} for s, (rec_, _) in per_obj[o].items()}
                     for o in objectives}}
    if not found:
        lines.append("No finished run yet.")
    else:
        at = _after_preamble(lines, machines, bool(missing))
        lines[at:at] = ["Recommendation per condition and temperature:", "", *recs, ""]
    # "E[L](3)" would be a Markdown link: escaped in the file (the log keeps it plain).
    (out / "RESULTS.md").write_text("\n".join(lines).replace("E[L](", "E[L]\\(") + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        fields = ["condition", "objective", "versus", "temperature", "text_temperature", "approximate", "seeds",
                  "seed_list", "tokens_per_run", "heldout_responses", "metric", "value", "lo", "hi", "hier_lo",
                  "hier_hi", "resp_lo", "resp_hi", "per_seed"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(csv_rows)
    write_json(out / "summary.json", json.loads(json.dumps(summary, default=str)))
    log(f"report: {out / 'RESULTS.md'}, {out / 'results.csv'}")
    for rec in recs:
        log("recommendation " + rec[2:])
    return summary


def _after_preamble(lines: list[str], machines: list[str], partial: bool) -> int:
    """Where the recommendation lines go: after the title, the settings paragraph, the held-out
    text's line, the partial study's line and the machines' lines."""
    return 2 + 2 + 2 + (2 if partial else 0) + len(machines)


def report_from_pack(src: Path, work: Path, out: Path, plan_fields: dict, *, num_boot: int = 1000) -> dict:
    """The report of a ``--pack`` folder without the model or the prompts: its finished runs
    (``rows.npz`` and ``record.json``, checked against MANIFEST.json's sha256) and the responses
    stage's ``responses.json`` copied into the empty folder ``work``, the pack's manifest into
    ``work/provenance.jsonl`` (as ``--unpack`` records it), then :func:`write_report` of the plan
    ``plan_fields`` (a report's ``summary.json`` ``plan``) into ``out``."""
    import hashlib

    from bebop_megatron.study.driver import StudyPlan
    from bebop_megatron.study.log import StudyError
    from bebop_megatron.study.pack import MANIFEST, PROVENANCE, RESPONSES_FILE, machine

    src, work = Path(src), Path(work)
    if work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise StudyError(f"{work}: not an empty folder (the pack's runs are restored into an empty folder)")
    manifest = json.loads((src / MANIFEST).read_text())
    files = {}  # every file checked before anything is written
    for name, entry in sorted((manifest.get("runs") or {}).items()):
        for f, sha in (("rows.npz", entry.get("rows_sha256")), ("record.json", entry.get("record_sha256"))):
            path = src / "runs" / name / f
            blob = path.read_bytes() if path.is_file() else b""
            if hashlib.sha256(blob).hexdigest() != sha:
                raise StudyError(f"{src}: runs/{name}/{f} is missing or differs from {MANIFEST}'s sha256 (a damaged "
                                 "pack)")
            files[work / "runs" / name / f] = blob
    for path, blob in files.items():  # rows.npz before record.json: a run is finished once both exist
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    if (src / "responses" / RESPONSES_FILE).is_file():
        (work / "data").mkdir(parents=True, exist_ok=True)
        (work / "data" / RESPONSES_FILE).write_bytes((src / "responses" / RESPONSES_FILE).read_bytes())
    (work / PROVENANCE).write_text(json.dumps({"pack": str(src), "unpacked_on": machine(), "manifest": manifest},
                                              sort_keys=True) + "\n")
    fields = {k: v for k, v in plan_fields.items() if k in StudyPlan.__dataclass_fields__}
    fields["temperatures"] = tuple(fields.get("temperatures", ()))
    plan = StudyPlan(work=work, out=Path(out), meg=Path(), train_files=[], valid_files=[], **fields)
    return write_report(plan, num_boot=num_boot)


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
