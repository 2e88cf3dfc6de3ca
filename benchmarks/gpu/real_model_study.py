"""The real-model objective study on one GPU: tools/objective_study.py on SmolLM2-135M-Instruct, carried over.

    # here (CPU, PyPI reachable): the files that travel to the GPU machine, in ignored folders
    .venv/bin/python benchmarks/gpu/real_model_study.py carry [--num-train 20000 --num-heldout 500]
    # on the GPU machine (benchmarks/gpu/real_model.sh wraps these; see benchmarks/README.md)
    python3 benchmarks/gpu/real_model_study.py receive --part 1      # call 1: part 1 and the prompts
    python3 benchmarks/gpu/real_model_study.py receive --part 2      # call 2: part 2, reassembled, sha256
    # the study (same call or the next): the tool on the carried model and prompts, its options after these
    python3 benchmarks/gpu/real_model_study.py objective-study --out $OUT --seeds 0,1,2 --tokens 1000000
    # the tool's tiny dry run: a random tiny Llama and random prompts that it writes itself, at tiny
    # sizes (the GPU smoke check of call 1 with --device cuda; on the CPU with --device cpu)
    python3 benchmarks/gpu/real_model_study.py objective-study --dry-run --device cpu --work DIR --out DIR

``objective-study`` dequantizes the reassembled GGUF (``bebop_megatron/hub.py``) into
``WORK/hf`` once, then runs ``tools/objective_study.py --hf-dir WORK/hf --prompts WORK/prompts
--work WORK/objective_study --out OUT --device DEVICE --title ... --keep-checkpoints`` and any
other option of the tool given after these (its stages resume from ``WORK/objective_study``;
docs/study.md). Its report lands in ``--out``: RESULTS.md, results.csv, curves_<condition>.png,
summary.json, study.log. Then the heads that come back for real speculative decoding here
(``benchmarks/speculative.py --heads``), MTP weights only, bfloat16
(``real_model_heads.export_heads``): of the study's last condition and first seed, the ce head
and the other objective's head of the highest held-out E[L](3) RS at T=1, as
``OUT/head_<condition>_<objective>_seed<S>.pt`` (``--no-heads``: none, and the tool's run
checkpoints are not kept).

The old ``study`` subcommand (its own calibration, time-fitted steps, summary.json and
positions_*.npz, ``real_model_report.py``) was deleted once the tool did all of it; it produced
``benchmarks/real_model/RESULTS_gpu.md`` (git show 9e55553:benchmarks/gpu/real_model_study.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "real_model"))

from bebop_megatron import hub as models  # noqa: E402  (the model registry)
from real_model_files import (STATUS_FILE, SPEC, StudyError, carry, log, make_tiny_model,  # noqa: E402
                              make_tiny_prompts, receive)

DEFAULT_WORK = REPO / ".gpu_work"  # ignored: stays on the machine between back-to-back calls
# The dry run's sizes (the tool's options; any given after them win): 24 train and 6 held-out
# prompts, 6 steps of 4 rows of 64 tokens per run, two objectives, both conditions.
DRY_RUN = ["--num-train", "24", "--num-heldout", "6", "--max-new-tokens", "24", "--gen-batch-size", "8",
           "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--tokens", str(6 * 4 * 64),
           "--curve-points", "3", "--curve-rows", "4", "--eval-chunk-positions", "64", "--loss-chunk-tokens", "512",
           "--objectives", "ce,e2e_tv", "--conditions", "fresh,existing", "--existing", "ce:512",
           "--num-boot", "20"]


def dequantize(work: Path) -> Path:
    """The reassembled GGUF as an HF folder, ``WORK/hf`` (once: a complete one is reused)."""
    hf = work / "hf"
    if (hf / STATUS_FILE).is_file():
        return hf
    gguf = work / "model.gguf"
    if not gguf.is_file():
        raise StudyError(f"{gguf} is missing: run 'receive --part 1' and 'receive --part 2' first")
    t0 = time.time()
    models.dequantize(gguf, hf, SPEC.hf_class, log=log)
    (hf / STATUS_FILE).write_text("ok\n")
    log(f"dequantize: {time.time() - t0:.0f} s")
    return hf


def objective_study_argv(args, hf: Path, prompts: Path) -> list[str]:
    """The command line of ``tools/objective_study.py``: the model and prompts, its work folder
    beside the carried files, the report in ``--out``; the dry run's sizes, then the caller's options."""
    argv = ["--hf-dir", str(hf), "--prompts", str(prompts), "--work", str(Path(args.work) / "objective_study"),
            "--out", str(args.out), "--device", args.device,
            "--title", "tiny random Llama (dry run)" if args.dry_run else SPEC.title]
    if not args.no_heads:
        argv.append("--keep-checkpoints")
    return argv + (DRY_RUN if args.dry_run else []) + args.tool_args


def objective_study(args) -> None:
    """The objective study tool on the carried model (or the dry run's), then the returned heads."""
    import importlib.util

    work = Path(args.work)
    if args.dry_run:
        hf, prompts = make_tiny_model(work / "tiny_hf"), make_tiny_prompts(work / "tiny_prompts")
    else:
        hf, prompts = dequantize(work), work / "prompts"
    argv = objective_study_argv(args, hf, prompts)
    spec = importlib.util.spec_from_file_location("objective_study_tool", REPO / "tools" / "objective_study.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(argv)
    if not args.no_heads:
        from real_model_heads import export_heads

        parsed = tool.parse_args(argv)
        export_heads(work / "objective_study", Path(args.out), conditions=parsed.conditions, seeds=parsed.seeds,
                     objectives=parsed.objectives, device=args.device)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("carry", help="here: split the GGUF and write the prompts into .gpu_carry1/.gpu_carry2")
    c.add_argument("--cache", default=None, help="model cache (default $BEBOP_CACHE/smollm2-135m)")
    c.add_argument("--num-train", type=int, default=20000)
    c.add_argument("--num-heldout", type=int, default=500)
    c.add_argument("--seed", type=int, default=1234)
    r = sub.add_parser("receive", help="GPU machine: take a carried part out of the tree (and reassemble)")
    r.add_argument("--part", type=int, choices=(1, 2), required=True)
    r.add_argument("--work", default=str(DEFAULT_WORK))
    o = sub.add_parser("objective-study", help="GPU machine: tools/objective_study.py on the carried model and prompts "
                                               "(seeds, intervals over responses; docs/study.md), then the heads; the "
                                               "tool's other options (--objectives, --seeds, --tokens, --conditions, "
                                               "...) follow")
    o.add_argument("--work", default=str(DEFAULT_WORK),
                   help="the carried files (model.gguf, prompts/); the tool's work folder is WORK/objective_study")
    o.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks" / "gpu" / "out"),
                   help="the report and the heads (default $OUT, else benchmarks/gpu/out)")
    o.add_argument("--device", default="cuda", choices=("cpu", "cuda"), help="default cuda")
    o.add_argument("--dry-run", action="store_true",
                   help="a random tiny Llama and prompts written in WORK, at tiny sizes (no carried files needed)")
    o.add_argument("--no-heads", action="store_true",
                   help="no head files in --out (and the tool keeps no run checkpoints)")
    args, extra = p.parse_known_args(argv)
    if args.command == "objective-study":
        args.tool_args = extra  # the tool's own options: it checks them
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        {"carry": carry, "receive": receive, "objective-study": objective_study}[args.command](args)
    except (StudyError, models.ModelError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
