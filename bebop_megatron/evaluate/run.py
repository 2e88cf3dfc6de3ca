"""The acceptance report of trained MTP heads (``tools/eval_acceptance.py``): the run's config
re-targeted at the evaluation's layout and data, the held-out rows (or on-policy samples), every
micro-batch's statistics (:mod:`.statistics`), the decode-exact forecast's labels, the speed-up
model's costs, ``report.json`` and the plots.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from omegaconf import OmegaConf
from tqdm import tqdm

from bebop_megatron.platform.outputs import write_json
from bebop_megatron.config import load_config
from bebop_megatron.data import DataError, check_trainable, eval_batches
from bebop_megatron.data.builder import build_synthetic_held_out, build_valid_dataset
from bebop_megatron.data.generate import read_prompts
from bebop_megatron.data.tokenizer import tokenizer_from_dir
from bebop_megatron.evaluate.options import EvalError, is_synthetic, resolve_checkpoint
from bebop_megatron.evaluate.statistics import micro_batch_statistics
from bebop_megatron.metrics.plots import PLOTS, write_all
from bebop_megatron.metrics.report import SUM_KEYS, AcceptanceReport
from bebop_megatron.metrics.speedup import Costs, measure_costs, speedup_table
from bebop_megatron.metrics.summary import summary_lines
from bebop_megatron.platform import init_distributed, resolve_device
from bebop_megatron.speculative.megatron_model import MegatronSpecModel
from bebop_megatron.speculative.onpolicy import held_out_prompts, recorded_temperature, sample_rows
from bebop_megatron.speculative.session import prompt_ids, stop_ids_of
from bebop_megatron.training import synthetic_backbone
from bebop_megatron.training.checkpoint import load_trained_model, read_common_state
from bebop_megatron.training.parallel import setup_parallel
from bebop_megatron.training.resume import damage, newest_intact_before


def check_intact(ckpt_path: str) -> None:
    """One line for a damaged checkpoint (a truncated shard, ``.metadata`` or ``metadata.json``:
    the trainer's own check), naming the newest intact one before it."""
    problem = damage(ckpt_path)
    if problem:
        previous = newest_intact_before(os.path.dirname(ckpt_path), ckpt_path)
        hint = (f"the newest intact checkpoint before it is {previous}: pass --checkpoint {previous}" if previous
                else "there is no intact checkpoint before it")
        raise EvalError(f"checkpoint {ckpt_path} is damaged: {problem}; {hint}")


def eval_config(ckpt_path: str, args, world: int, device: str):
    """The training run's config, re-targeted at this evaluation's layout and data."""
    try:
        with warnings.catch_warnings():  # dist checkpointing's note on a 1-rank world, not about this run
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            common = read_common_state(ckpt_path)
    except Exception as err:  # a directory that is not a dist checkpoint
        raise EvalError(f"{ckpt_path}: cannot read the checkpoint ({type(err).__name__}: {err})") from None
    if "config_yaml" not in common:
        raise EvalError(f"{ckpt_path}: the checkpoint holds no config_yaml (not written by the trainer?)")
    saved = OmegaConf.to_container(OmegaConf.create(common["config_yaml"]))
    model_parallel = args.tensor_parallel * args.context_parallel
    if world % model_parallel:
        raise EvalError(f"--tensor-parallel {args.tensor_parallel} x --context-parallel {args.context_parallel} does "
                         f"not divide the world size {world}; launch with torchrun --nproc_per_node {model_parallel} "
                         "(or a multiple of it)")
    dp = world // model_parallel
    overrides = [
        f"device={device}", f"parallel.tensor={args.tensor_parallel}", "parallel.pipeline=1",
        "parallel.pipeline_layout=null", f"parallel.context={args.context_parallel}",
        "parallel.sequence_parallel=false",
        "parallel.expert=1", "parallel.expert_tensor=null",
        f"train.micro_batch_size={args.micro_batch_size}", f"train.global_batch_size={args.micro_batch_size * dp}",
    ]
    if is_synthetic(args):
        if saved.get("data", {}).get("train_files"):
            raise EvalError("--data synthetic: the checkpoint was trained on data files, not on the synthetic "
                             "language; pass held-out files of that data")
    else:
        overrides.append("data.valid_files=[" + ",".join(json.dumps(p) for p in args.data) + "]")
    if saved.get("precision") == "fp8":
        overrides.append("precision=bf16")  # the weights are bf16; acceptance needs no FP8 GEMMs
    return load_config(None, overrides, defaults=saved)


def data_mismatch(cfg, args) -> str | None:
    """The warning for data files given to a run trained on the synthetic language (no
    ``data.train_files``): its tokens are the language's, the files' are the tokenizer's."""
    if is_synthetic(args) or cfg.data.train_files:
        return None
    return (f"warning: the checkpoint was trained on the synthetic language (no data.train_files) and --data "
            f"{' '.join(map(str, args.data))} is tokenized with data.tokenizer "
            f"({cfg.data.tokenizer or 'the byte tokenizer'}): the heads are measured on text of another kind; "
            "--data synthetic evaluates them on their own language")


def held_out_dataset(cfg, args, progress: bool):
    """The held-out rows: ``--data`` files, or samples of the run's synthetic language."""
    if is_synthetic(args):
        return build_synthetic_held_out(cfg, args.synthetic_samples)
    return build_valid_dataset(cfg, progress=progress)


def data_sampling(args) -> tuple[float | None, str]:
    """The temperature the held-out text was sampled at from this backbone, and where that is
    known from: ``--sample`` (every temperature), ``--data-temperature``, or every data file's
    ``<file>.settings.json``. ``(None, reason)`` otherwise."""
    if args.sample:
        return None, "--sample: continuations sampled from this backbone at each temperature"
    if args.data_temperature is not None:
        return args.data_temperature, f"--data-temperature {args.data_temperature:g}"
    if is_synthetic(args):
        return None, "the synthetic language is not sampled from the backbone (pass --sample)"
    return recorded_temperature(list(args.data))


def sample_on_policy(model, cfg, dataset, num_rows: int, tau: float, args, rank: int, world: int):
    """``--sample``: continuations of the held-out prompts (or of ``--sample-prompts``, read as
    tools/speculative_generate.py reads them) sampled from the backbone at ``tau``, as rows."""
    stop_ids = ()
    if args.sample_prompts:
        tokenizer = tokenizer_from_dir(cfg.data.tokenizer)
        lines = read_prompts(args.sample_prompts, drop_response=True).prompts
        prompts = [prompt_ids(tokenizer, p.messages) for p in lines]
        stop_ids = stop_ids_of(tokenizer)
    else:
        prompts = held_out_prompts(dataset, num_rows)
        if not is_synthetic(args):  # the synthetic language has no end-of-text token
            stop_ids = stop_ids_of(tokenizer_from_dir(cfg.data.tokenizer))
    rows = sample_rows(MegatronSpecModel(model, cfg.model.vocab_size), prompts, temperature=tau,
                       max_new_tokens=args.max_new_tokens, seq_length=cfg.train.seq_length, seed=args.seed,
                       stop_ids=stop_ids, rank=rank, world=world)
    if rank == 0:
        new = sum(len(t) - p for p, t in rows.texts)
        print(f"T={tau:g}: sampled {new} tokens after {len(prompts)} prompts from the backbone", flush=True)
    return rows


def cost_model(args, cfg, model, gamma: int, device: str):
    """The speed-up model's costs: given by the flags, or measured here (every rank takes part:
    the tensor-parallel forwards are collective)."""
    if args.cost_target_ms is not None:
        return Costs.from_times(args.cost_target_ms, args.cost_draft_ms, args.cost_overhead_ms, source="given",
                                method="given with --cost-target-ms / --cost-draft-ms / --cost-overhead-ms")
    if args.cost_ratio is not None:
        return Costs.from_ratio(args.cost_ratio, method="given with --cost-ratio")
    costs = measure_costs(model, context=args.cost_context or cfg.train.seq_length, gamma=gamma,
                          repeats=args.cost_repeats, warmup=2, device=device, vocab_size=cfg.model.vocab_size,
                          barrier=dist.barrier if dist.get_world_size() > 1 else None)
    if args.cost_overhead_ms:
        costs = Costs.from_times(costs.target_ms, costs.draft_ms, args.cost_overhead_ms, "measured", costs.method)
    return costs


def evaluate(args) -> dict | None:
    """The whole evaluation of ``tools/eval_acceptance.py``'s ``args`` on every rank; rank 0 writes
    ``report.json`` and the plots into ``args.out_dir`` and returns the result (other ranks: None)."""
    ckpt_path = resolve_checkpoint(args.checkpoint)
    device = resolve_device(args.device)
    rank, world = init_distributed(device)  # before reading the checkpoint: dist checkpointing expects it
    check_intact(ckpt_path)
    cfg = eval_config(ckpt_path, args, world, device)
    K = cfg.mtp.num_steps
    gamma = args.gamma if args.gamma is not None else K
    if not 1 <= gamma <= K:
        raise EvalError(f"--gamma must be in 1..{K} (the checkpoint's mtp.num_steps), got {gamma}")
    setup_parallel(cfg, world)
    mismatch = data_mismatch(cfg, args)
    if mismatch and rank == 0:
        print(mismatch, file=sys.stderr, flush=True)
    dataset = held_out_dataset(cfg, args, progress=not args.no_progress and rank == 0)
    if dataset is None or len(dataset) == 0:
        raise EvalError(f"no held-out rows in {args.data}")
    check_trainable(dataset, "--data", "evaluate")  # before the model: no valid position, no acceptance to measure
    synthetic_backbone.prepare(cfg, rank)  # a fitted synthetic backbone missing from the cache is rebuilt
    model = load_trained_model(cfg, ckpt_path, device)
    comm = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")

    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    num_rows = len(dataset) if args.max_rows <= 0 else min(args.max_rows, len(dataset))
    max_entropy = math.log(cfg.model.vocab_size)  # the padded columns are excluded
    num_bins = max(1, math.ceil(max_entropy / args.entropy_bin_width))
    edges = [min(i * args.entropy_bin_width, max_entropy) for i in range(num_bins + 1)]
    report = AcceptanceReport(args.temperatures, K, gamma, edges, num_scatter=args.scatter_points if rank == 0 else 0,
                              keep_positions=bool(args.positions_out), max_position=cfg.train.seq_length)
    generator = torch.Generator(device=comm).manual_seed(args.seed + 1000 * dp_rank)
    sim_left = args.sim_positions
    # --sample: each temperature evaluates its own on-policy continuations; otherwise the data, once.
    passes = ([(ti, sample_on_policy(model, cfg, dataset, num_rows, tau, args, rank, world))
               for ti, tau in enumerate(args.temperatures)] if args.sample else [(None, dataset)])
    for ti, rows in passes:
        n = len(rows) if args.sample else num_rows
        batches = eval_batches(rows, num_rows=n, global_batch_size=args.micro_batch_size * dp_size,
                               micro_batch_size=args.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        total = math.ceil(n / (args.micro_batch_size * dp_size))
        desc = "eval" if ti is None else f"eval T={args.temperatures[ti]:g}"
        for micro in tqdm(batches, total=total, desc=desc, unit="batch", disable=args.no_progress or rank != 0):
            for batch in micro:
                sim_left -= micro_batch_statistics(model, batch, report, args, K=K, tp_group=tp_group,
                                                   sim_budget=sim_left, generator=generator, device=comm,
                                                   vocab_size=cfg.model.vocab_size,
                                                   temperature_indices=None if ti is None else [ti])
        if args.sample:
            sim_left = args.sim_positions  # every temperature simulates its own budget
    report.reduce(dp_group)
    if not report.sums[0][SUM_KEYS.index("count")][0]:  # the same on every rank after the reduce
        raise DataError(f"--data: the {num_rows} rows evaluated (--max-rows) hold no position an MTP step can be "
                        "evaluated at (every trained token is among its document's first two or truncated away); "
                        "evaluate more rows")
    positions = report.position_rows(dp_group) if args.positions_out else None
    costs = None if args.no_speedup else cost_model(args, cfg, model, gamma, comm)
    if rank != 0:
        return None
    if positions is not None:
        os.makedirs(os.path.dirname(os.path.abspath(args.positions_out)), exist_ok=True)
        torch.save(positions, args.positions_out)
    per_t = report.summary()
    sampled_at, exact_source = data_sampling(args)
    for tau, entry in zip(args.temperatures, per_t.values()):
        entry["decode_exact"] = bool(args.sample or (sampled_at is not None and abs(tau - sampled_at) < 1e-9))
        entry["decode_exact_source"] = (exact_source if entry["decode_exact"] or sampled_at is None else
                                        f"{exact_source}; not at T={tau:g}")
    speedup = None if costs is None else speedup_table(per_t, costs, num_positions=K)
    ref = min(args.temperatures, key=lambda t: abs(t - 1.0))
    clear_report(args.out_dir)
    plots = write_all(per_t, report.scatter[args.temperatures.index(ref)], f"{ref:g}", args.out_dir, speedup=speedup)
    result = {
        "checkpoint": ckpt_path,
        "data": list(args.data),
        "num_rows": num_rows,
        "num_positions": per_t[f"{ref:g}"]["count"][0],
        "num_steps": K,
        "gamma": gamma,
        "layout": {"tensor": cfg.parallel.tensor, "context": cfg.parallel.context, "data": dp_size,
                   "device": device},
        "temperatures": [float(t) for t in args.temperatures],
        "sampled": ({"mode": "--sample", "prompts": args.sample_prompts or "the held-out data's",
                     "max_new_tokens": args.max_new_tokens, "seed": args.seed} if args.sample else None),
        "reference_temperature": ref,
        "per_temperature": per_t,
        "speedup": speedup,
        "plots": plots,
        "warnings": [mismatch] if mismatch else [],
    }
    write_json(os.path.join(args.out_dir, "report.json"), result)
    return result


def clear_report(out_dir: str) -> None:
    """Remove an earlier report's own files from ``out_dir`` (``report.json``, the plots it
    lists and every plot this tool writes), so that a re-run leaves none of its plots beside
    the new ``report.json``; other files are kept."""
    report = os.path.join(out_dir, "report.json")
    names = {os.path.join(out_dir, f"{name}.png") for name in (*PLOTS, "speedup_vs_gamma")}
    try:
        with open(report) as f:
            listed = json.load(f).get("plots") or {}
        names.update(p for p in listed.values() if isinstance(p, str)
                     and os.path.realpath(os.path.dirname(p)) == os.path.realpath(out_dir))
    except (OSError, ValueError, AttributeError):
        pass  # no earlier report (or not one of ours): only the known names
    for path in (report, *names):
        if os.path.isfile(path):
            os.remove(path)


def print_summary(result: dict) -> None:
    """The console summary of a result (one line per temperature, then the speed-up lines)."""
    print("\n".join(summary_lines(result)))
