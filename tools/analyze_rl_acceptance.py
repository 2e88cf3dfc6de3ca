"""Split an RL run's acceptance drift into its entropy part and its draft/target mismatch part (Eq. 16).

    python tools/analyze_rl_acceptance.py --input wandb_export.csv --entropy-col entropy \
        --accept-col spec/accept_rate [--step-col Step] [--fit-fraction 0.2] [--out-dir rl_report]

    python tools/analyze_rl_acceptance.py --input steps.jsonl --entropy-col entropy \
        --alpha-cols alpha_1 alpha_2 alpha_3

Fits alpha ~ a + b H on the first ``--fit-fraction`` of the steps (where the MTP heads still
match the policy), then writes, for every later step, d_alpha_t = b (H_t - H_0) [entropy
part] + residual [mismatch part], a plot and a verdict: the share of the final change that
the mismatch explains, and whether online MTP updates are indicated (mismatch share >=
``--mismatch-threshold`` and a mismatch drop larger than ``--min-drop``).

Input: CSV (wandb's "Download CSV" works: a ``Step`` column, metric columns named
``RUN - METRIC`` and ``RUN - METRIC__MIN``/``__MAX``, which are ignored) or JSONL (one
object per step). A column flag matches a column name exactly or, in a wandb export, the
single ``RUN - NAME`` column. With ``--alpha-cols`` (per MTP step acceptance) every column
is split separately and the first one (step 1) decides the verdict. Acceptance rates must
lie in [0, 1] (an accepted length, ``--accept-col`` with ``--gamma N``, in [0, N]) and the
entropy must not be negative: a value outside is refused, naming the column and the row.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[1:]))
    parser.add_argument("--input", required=True, metavar="FILE", help="time series of RL steps: .csv or .jsonl")
    parser.add_argument("--format", choices=("auto", "csv", "jsonl"), default="auto",
                        help="input format (default: from the file extension, .jsonl/.json -> jsonl)")
    parser.add_argument("--step-col", default="Step", help="step column (default: Step, as in wandb exports)")
    parser.add_argument("--entropy-col", required=True, help="policy (target) entropy column")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--accept-col", help="one acceptance column: an acceptance rate, or an accepted length with --gamma")
    what.add_argument("--alpha-cols", nargs="+", metavar="COL", help="per MTP step acceptance columns, step 1 first")
    parser.add_argument("--gamma", type=int, metavar="N",
                        help="--accept-col is an accepted length: draft tokens accepted per verification out of N, "
                             "bonus token not counted (values in [0, N]; default: an acceptance rate in [0, 1])")
    parser.add_argument("--fit-fraction", type=float, default=0.2,
                        help="fraction of the steps (from the start) the entropy slope b is fitted on (default 0.2)")
    parser.add_argument("--mismatch-threshold", type=float, default=0.5,
                        help="mismatch share of the change from which online MTP updates are indicated (default 0.5)")
    parser.add_argument("--min-drop", type=float, default=0.01,
                        help="smallest mismatch drop (in the acceptance's units) worth acting on (default 0.01)")
    parser.add_argument("--drop-missing", action="store_true",
                        help="skip steps with an empty or NaN value in a used column (default: stop with an error)")
    parser.add_argument("--out-dir", default="rl_acceptance", help="writes rl_acceptance.json and .png here")
    args = parser.parse_args(argv)
    if not 0 < args.fit_fraction < 1:
        parser.error(f"--fit-fraction must be in (0, 1), got {args.fit_fraction}")
    if args.gamma is not None and (args.gamma < 1 or not args.accept_col):
        parser.error("--gamma must be >= 1 and goes with --accept-col (an accepted length), "
                     "not with --alpha-cols (rates)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):  # before the analysis, not after it
        raise ValueError(f"--out-dir {args.out_dir} exists and is not a directory")
    from bebop_megatron.cli import write_json
    from bebop_megatron.metrics.rl_drift import analyze, load_series, plot, verdict

    steps, entropy, series, notes = load_series(args)
    report = analyze(steps, entropy, series, args)
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "rl_acceptance.png")
    plot(steps, entropy, series, report, png)
    report["plot"] = png
    report["notes"] = notes
    report["verdict"] = verdict(report, args)
    splits = report.pop("_splits")
    write_json(os.path.join(args.out_dir, "rl_acceptance.json"), report)
    for note in notes:
        print(f"note: {note}")
    print(report["verdict"])
    print(f"wrote {png} and {os.path.join(args.out_dir, 'rl_acceptance.json')}")
    report["_splits"] = splits
    return report


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-analyze-rl-acceptance``)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        main(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
