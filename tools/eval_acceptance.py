"""Acceptance report of trained MTP heads on held-out data: JSON and PNG plots.

    python tools/eval_acceptance.py --checkpoint checkpoints/tiny_jsonl --data held_out.jsonl \
        --temperatures 0.6 0.8 1.0 1.2 --gamma 3 --out-dir acceptance_report

    torchrun --nproc_per_node 2 tools/eval_acceptance.py --checkpoint CKPT --data FILE --tensor-parallel 2

For each temperature T (both the draft and the target logits divided by T) it reports,
per MTP step, alpha_RS = sum min(p, q), alpha_TO = p(argmax q), top-1 agreement with the
data token, H(p), H(q), KL(p||q); the expected accepted length E[L](g), g = 1..gamma, per
position then averaged (Eq. 12), analytic and from simulated chains
(:mod:`bebop_megatron.speculative`) on a sample of positions; acceptance against target
entropy (binned, with fitted lines: Fig. 1a / Fig. 8), against temperature (Fig. 12a) and
the RS-vs-target-only boundary d_TV < 1 - p(argmax q) (Fig. 13).

Decode-exact forecast (:mod:`bebop_megatron.losses.decode_exact`): what speculative decoding
will measure, the expected accepted drafts per verification from the acceptance given each
realized token, with a bootstrap interval over texts; exact where the held-out text was sampled
from this backbone at that temperature (``--sample``, ``--data-temperature``, or the data's
``<file>.settings.json``), marked approximate otherwise. Acceptance by context-position bucket.

Speed-up (:mod:`bebop_megatron.metrics.speedup`): per temperature and gamma,
(1 + E[L](gamma)) / (1 + gamma * c_draft / c_target + overhead), and the recommended gamma
(the best one; 0 when plain decoding is faster), from the decode-exact E[L] where it is exact and
Eq. 12 otherwise. The costs are measured on this machine with
the checkpoint's model (medians of ``--cost-repeats`` timed forwards after warm-up, one
sequence of ``--cost-context`` tokens, full prefix recomputed: no KV cache; on CPU one
thread's CPU time, so that other load on a shared machine does not count), or given for your
GPU: ``--cost-target-ms`` and ``--cost-draft-ms`` (one target verification forward, one MTP
step) with ``--cost-overhead-ms``, or ``--cost-ratio`` (c_draft / c_target) alone. Gamma
stops at the checkpoint's ``mtp.num_steps`` measured draft positions (no extrapolation).

``--data synthetic`` evaluates a run trained on the built-in synthetic data on held-out
samples of the same language (``--synthetic-samples`` of them, after the training samples).

``--checkpoint`` is a training run's ``save.dir`` (its ``latest`` checkpoint is used) or
one ``iter_N`` directory; the run's config is read from it, and the backbone comes from its
``model.backbone_checkpoint`` / ``model.init_checkpoint`` (or, for a random backbone, the
same seeded initialisation). The model is loaded at TP=``--tensor-parallel``, PP=1 (dist
checkpointing reshards any saved layout) and CP=``--context-parallel`` (each row's forward
split over C ranks as in training, ``parallel.context``; the hidden states are gathered back
into whole rows, so each CP rank computes the statistics of the whole rows: no ``--sample``,
no measured costs); the other ranks of the world are data-parallel and share the rows.
Positions follow the training loss: step k at t is valid when t+k is a trained token of t's
document, and a chain stops at its first invalid step. Data without a valid position (e.g.
every response truncated away) is refused, not reported as alpha 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

DEFAULT_TEMPERATURES = (1.0,)
TEMPERATURES = (1e-3, 1e3)  # = bebop_megatron.config.loader.TEMPERATURE_RANGE (a test checks; importing it loads torch)
SYNTHETIC = "synthetic"  # --data synthetic: held-out samples of the run's synthetic language


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[1:]))
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="training save.dir (uses its latest checkpoint) or one iter_N checkpoint directory")
    parser.add_argument("--data", nargs="+", required=True, metavar="FILE",
                        help="held-out data: JSONL files (or indexed datasets), as data.valid_files; or 'synthetic' "
                             "for a run trained on the synthetic language")
    parser.add_argument("--temperatures", nargs="+", type=float, default=list(DEFAULT_TEMPERATURES),
                        help="sampling temperatures, 0.001 to 1000 as in training; both logits are divided by T "
                             "(default: 1.0)")
    parser.add_argument("--gamma", type=int, default=None,
                        help="drafted tokens per chain, <= the checkpoint's mtp.num_steps (default: mtp.num_steps)")
    parser.add_argument("--out-dir", default="acceptance_report",
                        help="writes report.json and the PNGs here (an earlier report's files there are replaced, "
                             "its plots that this run does not write removed; other files are kept)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="TP size to load the model at (default 1)")
    parser.add_argument("--context-parallel", type=int, default=1,
                        help="CP size: each row's model forward split over this many ranks (parallel.context; "
                             "default 1); the statistics then run on the whole rows")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="rows per forward (default 4)")
    parser.add_argument("--max-rows", type=int, default=0, help="evaluate the first N packed rows (0: all)")
    parser.add_argument("--chunk-positions", type=int, default=128,
                        help="positions whose logits are alive at once (bounds memory; default 128)")
    parser.add_argument("--sim-positions", type=int, default=256,
                        help="positions (per data-parallel rank) with simulated chains (default 256; 0: none)")
    parser.add_argument("--sim-trials", type=int, default=16, help="simulated chains per position (default 16)")
    parser.add_argument("--entropy-bin-width", type=float, default=0.5, help="nats per entropy bin (default 0.5)")
    parser.add_argument("--scatter-points", type=int, default=2000,
                        help="(step, position) points in the RS-vs-TO scatter plot (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated chains and of --sample")
    exact = parser.add_argument_group(
        "decode-exact forecast (what speculative decoding will measure; exact on text sampled from this backbone "
        "at the temperature evaluated)")
    exact.add_argument("--data-temperature", type=float, default=None, metavar="T",
                       help="the --data responses were sampled from this checkpoint's backbone at T (full "
                            "vocabulary); default: read from each file's <file>.settings.json "
                            "(tools/generate_responses.py) when every file has one")
    exact.add_argument("--sample", action="store_true",
                       help="first sample a continuation of every held-out prompt from the checkpoint's backbone at "
                            "each temperature (plain decoding with a KV cache) and evaluate those texts: every "
                            "temperature decode-exact (needs --tensor-parallel 1)")
    exact.add_argument("--max-new-tokens", type=int, default=None,
                       help="with --sample: tokens per continuation (default: up to the run's train.seq_length)")
    exact.add_argument("--sample-prompts", default=None, metavar="FILE",
                       help="with --sample: continue these prompts instead of the held-out data's own, read and "
                            "templated as tools/speculative_generate.py reads --prompts (its stop tokens too), so "
                            "that the forecast and a decoding run see the same prompts")
    parser.add_argument("--positions-out", default=None, metavar="FILE",
                        help="also save the per-position alpha_RS, alpha_TO, H(p) and chain mask ([K, N] per "
                             "temperature, torch.save) for bootstrap intervals over positions")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--synthetic-samples", type=int, default=256,
                        help="with --data synthetic: held-out samples of the run's synthetic language (default 256)")
    cost = parser.add_argument_group("speed-up cost model (default: measured here with the checkpoint's model)")
    cost.add_argument("--cost-target-ms", type=float, default=None, help="one target verification forward (ms)")
    cost.add_argument("--cost-draft-ms", type=float, default=None, help="one MTP draft step (ms)")
    cost.add_argument("--cost-overhead-ms", type=float, default=0.0,
                      help="other per-iteration time: sampling, acceptance, scheduling (ms; default 0)")
    cost.add_argument("--cost-ratio", type=float, default=None, help="c_draft / c_target instead of times")
    cost.add_argument("--cost-context", type=int, default=None,
                      help="measured: context tokens of the timed sequence (default: the run's train.seq_length)")
    cost.add_argument("--cost-repeats", type=int, default=5,
                      help="measured: timed repeats, after 2 warm-up ones (medians; default 5)")
    cost.add_argument("--no-speedup", action="store_true", help="no cost model (no timing)")
    args = parser.parse_args(argv)
    if (args.cost_target_ms is None) != (args.cost_draft_ms is None):
        parser.error("--cost-target-ms and --cost-draft-ms go together")
    if args.cost_ratio is not None and args.cost_target_ms is not None:
        parser.error("give either --cost-ratio or --cost-target-ms/--cost-draft-ms, not both")
    if args.cost_ratio is not None and args.cost_overhead_ms:
        parser.error("--cost-overhead-ms needs --cost-target-ms (the overhead is a fraction of c_target)")
    for name in ("cost_repeats", "synthetic_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(not TEMPERATURES[0] <= t <= TEMPERATURES[1] for t in args.temperatures):  # NaN fails too
        parser.error(f"--temperatures must all be in [{TEMPERATURES[0]:g}, {TEMPERATURES[1]:g}], "
                     f"got {args.temperatures}")
    for name in ("tensor_parallel", "context_parallel", "micro_batch_size", "chunk_positions", "sim_trials"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("sim_positions", "scatter_points"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not args.entropy_bin_width > 0:
        parser.error("--entropy-bin-width must be > 0")
    if args.data_temperature is not None and not TEMPERATURES[0] <= args.data_temperature <= TEMPERATURES[1]:
        parser.error(f"--data-temperature must be in [{TEMPERATURES[0]:g}, {TEMPERATURES[1]:g}], "
                     f"got {args.data_temperature}")
    for name in ("max_new_tokens", "sample_prompts"):
        if getattr(args, name) is not None and not args.sample:
            parser.error(f"--{name.replace('_', '-')} goes with --sample")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.sample and args.data_temperature is not None:
        parser.error("--sample evaluates freshly sampled text: --data-temperature does not apply")
    if args.sample and args.tensor_parallel != 1:
        parser.error("--sample decodes at --tensor-parallel 1 (data-parallel ranks share the prompts)")
    if args.context_parallel > 1 and args.sample:
        parser.error("--sample decodes whole sequences: use --context-parallel 1")
    if args.context_parallel > 1 and not (args.no_speedup or args.cost_ratio is not None
                                          or args.cost_target_ms is not None):
        parser.error("--context-parallel > 1 measures no costs (the timed forwards run whole sequences): give "
                     "--cost-ratio or --cost-target-ms/--cost-draft-ms, or pass --no-speedup")
    return args


# ----------------------------------------------------------------------------- setup


class EvalError(ValueError):
    """A wrong flag, checkpoint or data set: every rank finds it alike, so only rank 0 prints it
    (:func:`bebop_megatron.cli.run_cli`; a plain ``ValueError`` is printed by every rank)."""

    same_on_every_rank = True


def resolve_checkpoint(path: str) -> str:
    """A save.dir (its ``latest``) or one checkpoint directory; plain ``os`` checks, so a wrong
    path fails before the (slow) Megatron imports."""
    marker = os.path.join(path, "latest")  # training.checkpoint.LATEST
    if os.path.isfile(marker):
        with open(marker) as f:
            found = os.path.join(path, f.read().strip())
        if not os.path.isfile(os.path.join(found, "metadata.json")):
            raise EvalError(f"checkpoint not found: {marker} names {found}, which is not a complete checkpoint")
        return found
    if os.path.isfile(os.path.join(path, "bebop_model.yaml")):  # convert.importer's record of the sizes
        from bebop_megatron.config.checkpoints import import_given_as_training_checkpoint

        raise EvalError(import_given_as_training_checkpoint(path))
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    raise EvalError(f"checkpoint not found: {path} (expected a save.dir with 'latest' or an iter_N directory)")


def check_intact(ckpt_path: str) -> None:
    """One line for a damaged checkpoint (a truncated shard, ``.metadata`` or ``metadata.json``:
    the trainer's own check), naming the newest intact one before it."""
    from bebop_megatron.training.resume import damage, newest_intact_before

    problem = damage(ckpt_path)
    if problem:
        previous = newest_intact_before(os.path.dirname(ckpt_path), ckpt_path)
        hint = (f"the newest intact checkpoint before it is {previous}: pass --checkpoint {previous}" if previous
                else "there is no intact checkpoint before it")
        raise EvalError(f"checkpoint {ckpt_path} is damaged: {problem}; {hint}")


def eval_config(ckpt_path: str, args, world: int, device: str):
    """The training run's config, re-targeted at this evaluation's layout and data."""
    from omegaconf import OmegaConf

    from bebop_megatron.config import load_config
    from bebop_megatron.training.checkpoint import read_common_state

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


def is_synthetic(args) -> bool:
    return list(args.data) == [SYNTHETIC]


def held_out_dataset(cfg, args, progress: bool):
    """The held-out rows: ``--data`` files, or samples of the run's synthetic language."""
    from bebop_megatron.data.builder import build_synthetic_held_out, build_valid_dataset

    if is_synthetic(args):
        return build_synthetic_held_out(cfg, args.synthetic_samples)
    return build_valid_dataset(cfg, progress=progress)


def data_sampling(args) -> tuple[float | None, str]:
    """The temperature the held-out text was sampled at from this backbone, and where that is
    known from: ``--sample`` (every temperature), ``--data-temperature``, or every data file's
    ``<file>.settings.json``. ``(None, reason)`` otherwise."""
    from bebop_megatron.speculative.onpolicy import recorded_temperature

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
    from bebop_megatron.data.tokenizer import tokenizer_from_dir
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel
    from bebop_megatron.speculative.onpolicy import held_out_prompts, sample_rows
    from bebop_megatron.speculative.session import prompt_ids, stop_ids_of

    stop_ids = ()
    if args.sample_prompts:
        from bebop_megatron.data.generate import read_prompts

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
    import torch.distributed as dist

    from bebop_megatron.metrics.speedup import Costs, measure_costs

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


# ----------------------------------------------------------------------------- evaluation


def micro_batch_statistics(model, batch, report, args, *, K, tp_group, sim_budget, generator, device, vocab_size,
                           temperature_indices=None):
    """Add one micro-batch to ``report`` at the temperatures ``temperature_indices`` (default:
    all); returns the number of positions simulated.

    Columns from ``vocab_size`` on (Megatron's vocabulary padding) are excluded everywhere."""
    import torch

    from bebop_megatron.data import attention_mask
    from bebop_megatron.metrics import acceptance_rows
    from bebop_megatron.training.loss import chain_valid, output_weight_of

    mask = attention_mask(batch.segment_ids)
    batch = batch.to(device)
    with torch.no_grad():
        hidden = whole_row_hidden(model, batch, None if mask is None else mask.to(device), K)
    S, B = batch.tokens.shape[1], batch.tokens.shape[0]
    chunks = torch.chunk(hidden, 1 + K, dim=0)  # [S, B, H] each: backbone, then MTP steps 1..K
    weight_VH = output_weight_of(model).float()
    H = hidden.shape[-1]
    chain_KN = chain_valid(batch.loss_mask, K, batch.segment_ids).transpose(1, 2).reshape(K, S * B)
    draft_KNH = torch.stack([c.reshape(S * B, H) for c in chunks[1:]]).float()
    # Step k at s is verified against the backbone at s+k; labels[s+k] is its data token.
    target_KNH = hidden.new_zeros((K, S, B, H), dtype=torch.float32)
    labels_KN = torch.zeros((K, S, B), dtype=torch.long, device=hidden.device)
    labels_SB = batch.labels.t()
    for k in range(1, K + 1):
        target_KNH[k - 1, : S - k] = chunks[0][k:].float()
        labels_KN[k - 1, : S - k] = labels_SB[k:]
    target_KNH, labels_KN = target_KNH.reshape(K, S * B, H), labels_KN.reshape(K, S * B)

    temps = list(range(len(report.temperatures))) if temperature_indices is None else list(temperature_indices)
    # The acceptance given the realized token and alpha_RS of every position, [K, S * B] per temperature.
    given = {ti: {mode: torch.zeros(K, S * B, dtype=torch.float64) for mode in ("rs", "to", "alpha_rs")}
             for ti in temps}
    positions = chain_KN[0].nonzero(as_tuple=True)[0]
    for start in range(0, len(positions), args.chunk_positions):
        idx = positions[start : start + args.chunk_positions]
        draft_logits, target_logits = draft_KNH[:, idx] @ weight_VH.t(), target_KNH[:, idx] @ weight_VH.t()
        for ti in temps:
            tau = report.temperatures[ti]
            rows = acceptance_rows(draft_logits, target_logits, tp_group=tp_group, target_temperature=tau,
                                   draft_temperature=tau, vocab_size=vocab_size, labels=labels_KN[:, idx])
            report.add_rows(ti, rows, chain_KN[:, idx], labels_KN[:, idx])
            cpu_idx = idx.cpu()
            for mode, key in (("rs", "accept_rs_label"), ("to", "accept_to_label"), ("alpha_rs", "alpha_rs")):
                given[ti][mode][:, cpu_idx] = rows[key].double().cpu()
    chain_KBS = chain_KN.view(K, S, B).transpose(1, 2).cpu()
    for ti in temps:
        per_mode = {mode: v.view(K, S, B).transpose(1, 2) for mode, v in given[ti].items()}
        report.add_decode(ti, per_mode, chain_KBS, batch.loss_mask, batch.segment_ids, batch.position_ids)
        report.add_position_rows(ti, per_mode["alpha_rs"], chain_KBS, batch.position_ids)

    G = report.G
    sim_idx = chain_KN[G - 1].nonzero(as_tuple=True)[0][:sim_budget]
    if len(sim_idx):
        draft_logits = _gather_vocab(draft_KNH[:G, sim_idx] @ weight_VH.t(), tp_group)[..., :vocab_size]  # [G, n, V]
        target_logits = _gather_vocab(target_KNH[:G, sim_idx] @ weight_VH.t(), tp_group)[..., :vocab_size]
        for ti in temps:
            tau = report.temperatures[ti]
            q = torch.softmax(draft_logits.double() / tau, -1).transpose(0, 1).contiguous()
            p = torch.softmax(target_logits.double() / tau, -1).transpose(0, 1).contiguous()
            report.simulate(ti, p, q, args.sim_trials, generator)
    return len(sim_idx)


def whole_row_hidden(model, batch, mask, K: int):
    """The model's hidden states ``[(1 + K) * S, B, H]`` of whole rows. Under context parallelism
    the forward runs this CP rank's chunks of the rows (as the trainer's) and the backbone's and
    every MTP step's hidden states are all-gathered over the CP group and put back in row order,
    so every CP rank computes the statistics of the whole rows."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bebop_megatron.model.cp_attention import shard_sequence, unshard_sequence

    C = parallel_state.get_context_parallel_world_size()
    if C == 1:
        return model(batch.tokens, batch.position_ids, mask)
    rank, group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
    local = model(*(shard_sequence(x, rank, C) for x in (batch.tokens, batch.position_ids)), mask)
    steps = []
    for part in torch.chunk(local, 1 + K, dim=0):  # [2L, B, H]: backbone, then MTP steps 1..K
        parts = [torch.empty_like(part) for _ in range(C)]
        dist.all_gather(parts, part.contiguous(), group=group)
        steps.append(unshard_sequence(parts, dim=0))
    return torch.cat(steps)


def _gather_vocab(logits_KnV, tp_group):
    import torch
    import torch.distributed as dist

    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return logits_KnV
    parts = [torch.empty_like(logits_KnV) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits_KnV.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def evaluate(args) -> dict | None:
    import torch
    from megatron.core import parallel_state
    from tqdm import tqdm

    from bebop_megatron.cli import write_json
    from bebop_megatron.data import DataError, check_trainable, eval_batches
    from bebop_megatron.metrics.plots import write_all
    from bebop_megatron.metrics.speedup import speedup_table
    from bebop_megatron.training import synthetic_backbone
    from bebop_megatron.metrics.report import SUM_KEYS, AcceptanceReport
    from bebop_megatron.platform import init_distributed, resolve_device
    from bebop_megatron.training.checkpoint import load_trained_model
    from bebop_megatron.training.parallel import setup_parallel

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
                              keep_positions=bool(args.positions_out))
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
    }
    write_json(os.path.join(args.out_dir, "report.json"), result)
    return result


def clear_report(out_dir: str) -> None:
    """Remove an earlier report's own files from ``out_dir`` (``report.json``, the plots it
    lists and every plot this tool writes), so that a re-run leaves none of its plots beside
    the new ``report.json``; other files are kept."""
    from bebop_megatron.metrics.plots import PLOTS

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
    from bebop_megatron.metrics.summary import summary_lines

    print("\n".join(summary_lines(result)))


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    resolve_checkpoint(args.checkpoint)  # a wrong path fails in a second, before the library import
    from bebop_megatron.cli import check_output_dir
    from bebop_megatron.config.sources import parse_sources

    try:
        check_output_dir(args.out_dir, "--out-dir")
    except ValueError as err:  # every rank finds it alike
        raise EvalError(str(err)) from None

    if not is_synthetic(args):
        parse_sources(args.data, "--data")  # named as given here, not as the config field it becomes
    if args.sample_prompts:
        from bebop_megatron.data.generate import read_prompts

        read_prompts(args.sample_prompts, drop_response=True)  # a wrong file fails before the model loads
    result = evaluate(args)
    if result is not None:
        print_summary(result)
    return result


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and usage errors before the library (and torch) import
    from bebop_megatron.cli import run_cli

    run_cli(lambda: main(sys.argv[1:]))
