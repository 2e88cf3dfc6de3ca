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

Decode-exact forecast (:mod:`bebop_megatron.chain.decode_exact`): what speculative decoding
will measure, the expected accepted drafts per verification from the acceptance given each
realized token, with a bootstrap interval over texts; exact where the held-out text was sampled
from this backbone at that temperature (``--sample``, ``--data-temperature``, or the data's
``<file>.settings.json``), marked approximate otherwise. Acceptance by context-position bucket.

Speed-up (:mod:`bebop_megatron.metrics.speedup`): per temperature and gamma,
(1 + E[L](gamma)) / (1 + gamma * c_draft / c_target + overhead), and the recommended gamma
(the best one; 0 when plain decoding is faster), from the decode-exact E[L] where it is exact and
Eq. 12 otherwise. The costs are measured with the checkpoint's model (medians of ``--cost-repeats``
timed forwards after warm-up, one sequence of ``--cost-context`` tokens, full prefix recomputed: no
KV cache; on CPU one thread's CPU time, so that other load does not count), or given for your
GPU: ``--cost-target-ms`` and ``--cost-draft-ms`` (one target verification forward, one MTP
step) with ``--cost-overhead-ms``, or ``--cost-ratio`` (c_draft / c_target) alone. Gamma
stops at the checkpoint's ``mtp.num_steps`` measured draft positions (no extrapolation).

``--data synthetic``: held-out samples of a synthetic-language run's language (``--synthetic-samples``).
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
import sys

DEFAULT_TEMPERATURES = (1.0,)
TEMPERATURES = (1e-3, 1e3)  # = bebop_megatron.config.loader.TEMPERATURE_RANGE (a test checks; importing it loads torch)


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
    if any(not TEMPERATURES[0] <= t <= TEMPERATURES[1] for t in args.temperatures):  # NaN fails too
        parser.error(f"--temperatures must all be in [{TEMPERATURES[0]:g}, {TEMPERATURES[1]:g}], "
                     f"got {args.temperatures}")
    for name in ("cost_repeats", "synthetic_samples", "tensor_parallel", "context_parallel", "micro_batch_size",
                 "chunk_positions", "sim_trials"):
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
    if args.data_temperature is not None and args.data == ["synthetic"]:
        parser.error("--data-temperature: the synthetic language's held-out samples come from the language, not "
                     "from this backbone, so their forecast stays approximate; pass --sample for text sampled from it")
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


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    from bebop_megatron.evaluate.options import EvalError, is_synthetic, resolve_checkpoint

    resolve_checkpoint(args.checkpoint)  # a wrong path fails in a second, before the library import
    from bebop_megatron.cli import check_output_dir
    from bebop_megatron.config.sources import parse_sources
    from bebop_megatron.evaluate.run import evaluate, print_summary

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


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-eval-acceptance``)."""
    argv = sys.argv[1:] if argv is None else argv
    parse_args(argv)  # --help and usage errors before the library (and torch) import
    from bebop_megatron.cli import run_cli

    run_cli(lambda: main(argv))


if __name__ == "__main__":
    cli()
