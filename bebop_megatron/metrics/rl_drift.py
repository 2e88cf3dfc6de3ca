"""An RL run's acceptance drift split into its entropy part and its draft/target mismatch part
(Eq. 16), read from a wandb CSV export or a JSONL file of steps (``tools/analyze_rl_acceptance.py``).

Plain-numpy equivalent of the split (:func:`bebop_megatron.metrics.entropy.entropy_mismatch_split`)::

    b, a = polyfit(H[:n_fit], alpha[:n_fit], 1)          # alpha ~ a + b H where heads match the policy
    entropy_part = b * (H - H[:n_fit].mean()); mismatch_part = (alpha - alpha[:n_fit].mean()) - entropy_part
"""

from __future__ import annotations

import csv
import json
import math
import os

import numpy as np

from bebop_megatron.metrics.entropy import entropy_mismatch_split
from bebop_megatron.metrics.plots import pyplot, save


# ------------------------------------------------------------------------- input


def read_table(path: str, fmt: str) -> tuple[list[str], list[dict]]:
    """(column names, rows as dicts of strings/numbers); ValueError naming the file (and line)."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: file not found")
    if fmt == "auto":
        fmt = "jsonl" if path.endswith((".jsonl", ".json")) else "csv"
    try:
        return _read_rows(path, fmt)
    except UnicodeDecodeError as err:  # a binary file (a .png, a wandb .wandb log, ...)
        raise ValueError(f"{path}: not a UTF-8 text file (byte {err.start + 1}); give a CSV or JSONL export") from None
    except csv.Error as err:  # e.g. "line contains NUL"
        raise ValueError(f"{path}: not a CSV file ({err}); give a CSV or JSONL export") from None


def _read_rows(path: str, fmt: str) -> tuple[list[str], list[dict]]:
    with open(path, newline="", encoding="utf-8") as f:
        if fmt == "csv":
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
        else:
            rows, columns = [], []
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{number}: expected a JSON object per line")
                rows.append(row)
                columns += [c for c in row if c not in columns]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return columns, rows


def resolve_column(name: str, columns: list[str], path: str, flag: str) -> str:
    """``name`` itself, or the one wandb column ``RUN - name`` (``__MIN``/``__MAX`` ignored)."""
    if name in columns:
        return name
    matches = [c for c in columns if c.endswith(f" - {name}")]
    if len(matches) == 1:
        return matches[0]
    plain = [c for c in columns if not c.endswith(("__MIN", "__MAX"))]
    if matches:
        raise ValueError(f"{path}: {flag} {name!r} matches several columns {matches}; pass the full column name")
    raise ValueError(f"{path}: {flag} {name!r} is not a column; columns: {plain}")


MISSING = ("", "nan", "NaN", "null", "None")


def is_text(value) -> bool:
    """A value that is neither a number nor missing (e.g. a run name)."""
    if value is None or isinstance(value, (int, float)) or (isinstance(value, str) and value.strip() in MISSING):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return True
    return False


def to_float(value) -> float:
    if value is None or (isinstance(value, str) and value.strip() in MISSING):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def load_series(args) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], list[str]]:
    """(steps, entropy, {name: acceptance}, notes) sorted by step, missing values handled."""
    columns, rows = read_table(args.input, args.format)
    step_col = resolve_column(args.step_col, columns, args.input, "--step-col")
    entropy_col = resolve_column(args.entropy_col, columns, args.input, "--entropy-col")
    names = [args.accept_col] if args.accept_col else args.alpha_cols
    accept_cols = {n: resolve_column(n, columns, args.input, "--accept-col" if args.accept_col else "--alpha-cols")
                   for n in names}
    used = {"step": step_col, "entropy": entropy_col, **accept_cols}
    for col in used.values():  # not missing values: --drop-missing would drop every row
        text = [i for i, r in enumerate(rows) if is_text(r.get(col))]
        if text:
            raise ValueError(f"{args.input}: column {col!r} holds text, not numbers ({len(text)} of {len(rows)} rows, "
                             f"first {rows[text[0]][col]!r} at data row {text[0] + 1}); pass a numeric column")
    table = {key: np.array([to_float(r.get(col)) for r in rows]) for key, col in used.items()}
    check_ranges(table, used, args)
    bad = ~np.isfinite(np.stack(list(table.values()))).all(0)
    notes = []
    if bad.any():
        which = [used[k] for k, v in table.items() if not np.isfinite(v).all()]
        first = int(np.flatnonzero(bad)[0])
        if not args.drop_missing:
            raise ValueError(
                f"{args.input}: {int(bad.sum())} of {len(bad)} rows have an empty or NaN value in {which} "
                f"(first at data row {first + 1}); pass --drop-missing to skip them"
            )
        notes.append(f"skipped {int(bad.sum())} rows with missing values in {which}")
        table = {k: v[~bad] for k, v in table.items()}
    order = np.argsort(table["step"], kind="stable")
    table = {k: v[order] for k, v in table.items()}
    if len(np.unique(table["step"])) != len(table["step"]):
        raise ValueError(f"{args.input}: column {step_col!r} repeats steps; export one run per file")
    return table["step"], table["entropy"], {n: table[n] for n in names}, notes


def check_ranges(table: dict[str, np.ndarray], used: dict[str, str], args) -> None:
    """Acceptance in [0, 1] ([0, gamma] for an accepted length), entropy >= 0 (missing values are
    left to the caller); ValueError naming the column and the first bad data row."""
    top = 1.0 if args.gamma is None else float(args.gamma)
    what = "an acceptance rate" if args.gamma is None else f"an accepted length out of --gamma {args.gamma}"
    hint = "; pass --gamma N for an accepted length in [0, N]" if args.gamma is None and args.accept_col else ""
    for key, values in table.items():
        if key == "step":
            continue
        if key == "entropy":
            outside, allowed = values < 0, "an entropy must be >= 0"
        else:
            outside, allowed = (values < 0) | (values > top), f"outside [0, {top:g}] for {what}{hint}"
        if outside.any():
            row = int(np.flatnonzero(outside)[0])
            raise ValueError(f"{args.input}: column {used[key]!r} has {values[row]:g} at data row {row + 1}: {allowed}")


# ------------------------------------------------------------------------- report


def analyze(steps, entropy, series: dict[str, np.ndarray], args) -> dict:
    results = {}
    for name, accept in series.items():
        try:
            split = entropy_mismatch_split(entropy, accept, args.fit_fraction)
        except ValueError as err:
            if "x is constant" in str(err):  # fit_line's name for the entropy series
                raise ValueError(f"{args.input}: --entropy-col {args.entropy_col!r} is constant over the fit window "
                                 f"(the first {args.fit_fraction:g} of the steps): the entropy slope is undefined; "
                                 "raise --fit-fraction or check the column") from None
            raise ValueError(f"{args.input}: {err}") from None
        if split.num_fit >= len(steps):
            raise ValueError(f"{args.input}: too few steps ({len(steps)}) after the fit window of {split.num_fit}")
        results[name] = split
    primary = next(iter(results))
    s = results[primary]
    indicated = bool(s.mismatch_share >= args.mismatch_threshold and s.final_mismatch_part <= -args.min_drop)
    return {
        "input": args.input,
        "num_steps": int(len(steps)),
        "fit_steps": int(s.num_fit),
        "primary": primary,
        "entropy_start": float(entropy[: s.num_fit].mean()),
        "entropy_end": float(entropy[-s.num_fit:].mean()),
        "series": {
            name: {
                "slope": r.slope, "intercept": r.intercept, "change": r.final_delta,
                "entropy_part": r.final_entropy_part, "mismatch_part": r.final_mismatch_part,
                "mismatch_share": r.mismatch_share,
            }
            for name, r in results.items()
        },
        "mismatch_share": s.mismatch_share,
        "online_mtp_updates_indicated": indicated,
        "_splits": results,
    }


def verdict(report: dict, args) -> str:
    s = report["series"][report["primary"]]
    lines = [
        f"{report['primary']}: entropy slope b = {s['slope']:+.4f} per nat (fitted on the first "
        f"{report['fit_steps']} of {report['num_steps']} steps)",
        f"change over the run: {s['change']:+.4f} = entropy part {s['entropy_part']:+.4f} "
        f"+ mismatch part {s['mismatch_part']:+.4f} (Eq. 16)",
        f"mismatch share of the change: {100 * s['mismatch_share']:.0f}%",
    ]
    if report["online_mtp_updates_indicated"]:
        lines.append("verdict: draft/target mismatch drives the drop; online MTP updates are indicated")
    elif s["mismatch_part"] <= -args.min_drop:
        lines.append("verdict: some mismatch drop, but entropy explains at least as much of the change; online MTP updates "
                     "are not clearly worth their cost")
    else:
        lines.append("verdict: no material mismatch drop; online MTP updates are not indicated")
    return "\n".join(lines)


def plot(steps, entropy, series, report, path) -> None:
    plt = pyplot()
    name = report["primary"]
    split = report["_splits"][name]
    accept = series[name]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(steps, accept, lw=1, label=f"{name} (measured)")
    top.plot(steps, accept[: split.num_fit].mean() + split.entropy_part, lw=1.5,
             label=f"entropy only: b (H_t - H_0), b = {split.slope:+.3f}")
    top.axvspan(steps[0], steps[split.num_fit - 1], color="0.9", label="fit window")
    top.set_ylabel("acceptance")
    ax_h = top.twinx()
    ax_h.plot(steps, entropy, color="0.5", lw=0.8, ls=":", label="entropy H")
    ax_h.set_ylabel("entropy (nats)")
    top.legend(loc="lower left", fontsize=8)
    bottom.plot(steps, split.delta, lw=1, label="change from step 0")
    bottom.plot(steps, split.entropy_part, lw=1, label="entropy part")
    bottom.plot(steps, split.mismatch_part, lw=1, label="mismatch part")
    bottom.axhline(0.0, color="0.6", lw=0.5)
    bottom.set_xlabel("RL step")
    bottom.set_ylabel("d acceptance")
    bottom.set_title(f"mismatch share {100 * report['mismatch_share']:.0f}%", fontsize=9)
    bottom.legend(fontsize=8)
    save(fig, path)
