"""Real speculative decoding with trained MTP heads: measured acceptance next to its prediction.

    python tools/speculative_generate.py --checkpoint checkpoints/tiny_jsonl --prompts prompts.jsonl \
        --gamma 3 --temperature 1.0 --max-new-tokens 128 --seed 0 --json out.json

--checkpoint is a training checkpoint or a full export directory of tools/convert_to_hf.py
(imported in memory as tools/convert_from_hf.py imports it; fp32). The MTP chain drafts
--gamma tokens (step k+1 gets step k's hidden state after the MTP final norm, as Megatron
trains it and SGLang / vLLM run it, or before it with --handoff pre_norm, and the token
drafted at step k), the
target verifies them all in one forward, and --mode rs accepts by rejection sampling
(min(1, p/q), resample from norm(max(0, p - q)), a bonus token when all are accepted) or
--mode to target-only (greedy drafts accepted with p(draft)). Top-p is off. Prompt lines as
for tools/generate_responses.py ("prompt" or "messages"); the chat template of the run's
data.tokenizer is applied with the generation prompt. A data file works as a prompts file
(e.g. the held-out data.valid_files): the "response" of a "prompt"/"response" line and the
trailing assistant message of a "messages" line are dropped alike.

Caches: Megatron's own inference cache cannot verify several tokens in one forward on CPU,
so the tool runs Megatron's modules with its own KV caches (backbone and each MTP step). By
default (--decoder batched) --batch-size prompts are decoded at once over static caches
(bebop_megatron/speculative/batched_spec.py: rows accept different numbers of drafts, each
row keeps its own cursor and its own seeded random draws, so a prompt's tokens do not depend
on the batch); --decoder single decodes one prompt at a time
(bebop_megatron/speculative/megatron_model.py). Both give the same tokens for the same
--seed, up to the rounding of batched float arithmetic. A verification costs one backbone
forward over gamma+1 new tokens per row; drafting costs gamma MTP-layer forwards over the few
positions whose inputs changed. --baseline also decodes each prompt (each batch) plainly (one
forward per token, its own caches, advanced in turn with the speculative run so that load
changes hit both alike) and reports the wall-time speed-up. tokens_per_second counts the new
tokens over the decoding's wall time (prefill, drafting, verification; a batch's time is
shared by its rows).

The JSON holds, per draft position, the measured acceptance rate and count; the mean accepted
length per verification (measured_accept_len, ci95: 95% CLT interval over verifications);
tokens per target forward; the wall time of target and draft; predicted_accept_len, Eq. 12
from the same model's teacher-forced alphas on the generated text; and
predicted_accept_len_decode, the decode-exact forecast from the same text (the expected
accepted drafts over the expected verifications given the emitted tokens, with a bootstrap
interval over prompts; exact in expectation, so it should fall inside the measured interval).
docs/acceptance.md ("Three numbers") says when each applies.
"""

from __future__ import annotations

import argparse
import sys

TEMPERATURES = (1e-3, 1e3)  # = bebop_megatron.config.loader.TEMPERATURE_RANGE (a test checks; importing it loads torch)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[1:]))
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="training save.dir (its latest checkpoint), one iter_N directory, or a full export "
                             "directory of tools/convert_to_hf.py (imported in memory, fp32)")
    parser.add_argument("--handoff", choices=("post_norm", "pre_norm"), default=None,
                        help="what draft step k hands step k+1: post_norm (after the MTP final norm: SGLang, and "
                             "vLLM since PR #45895) or pre_norm (DeepSeek-V3 / GLM-4.5 drafts in vLLM before it); "
                             "default the checkpoint's trained mtp.next_step_input, post_norm for an export")
    parser.add_argument("--prompts", required=True, metavar="FILE",
                        help="prompts JSONL, or a data JSONL (its responses / last assistant messages are dropped)")
    parser.add_argument("--gamma", type=int, default=3,
                        help="drafted tokens per verification (default 3); above mtp.num_steps only when one MTP "
                             "layer is repeated (mtp_use_repeated_layer), which is then reused as vLLM does")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature, 0.001 to 1000 as in training (default 1.0)")
    parser.add_argument("--mode", choices=("rs", "to"), default="rs",
                        help="rs: rejection sampling with sampled drafts; to: greedy drafts, target-only")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default 128)")
    parser.add_argument("--limit", type=int, default=None, help="use the first N prompts (N >= 1; default all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    parser.add_argument("--decoder", choices=("batched", "single"), default="batched",
                        help="batched: --batch-size prompts at once over static KV caches (default); single: one "
                             "prompt at a time")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="prompts decoded at once by --decoder batched (default 16)")
    parser.add_argument("--baseline", action="store_true",
                        help="also decode plainly (one target forward per token) and report the speed-up")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the statistics here (its directory must exist; a rate with nothing to measure, "
                             "e.g. a draft position never reached, is null)")
    args = parser.parse_args(argv)
    if not TEMPERATURES[0] <= args.temperature <= TEMPERATURES[1]:  # NaN fails too
        parser.error(f"--temperature must be in [{TEMPERATURES[0]:g}, {TEMPERATURES[1]:g}], got {args.temperature}")
    for name in ("gamma", "max_new_tokens", "limit", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:  # --limit 0 said "no prompt in the file"
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def decode(tokenizer, ids) -> str:
    """Text of ``ids``; ids the tokenizer does not know (a model vocabulary larger than the
    tokenizer's) are written as <|id:N|>."""
    known = [i for i in ids if i < tokenizer.vocab_size]
    if len(known) == len(ids):
        return tokenizer.decode(ids)
    return "".join(tokenizer.decode([i]) if i < tokenizer.vocab_size else f"<|id:{i}|>" for i in ids)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from bebop_megatron.cli import check_output_file, write_json
    from bebop_megatron.data.generate import read_prompts
    from bebop_megatron.speculative.session import resolve_checkpoint

    resolve_checkpoint(args.checkpoint)  # fail fast, before the model import
    if args.json:
        check_output_file(args.json, "--json")  # not after all the decoding
    prompt_set = read_prompts(args.prompts, args.limit, drop_response=True)

    from bebop_megatron.data.tokenizer import tokenizer_from_dir
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel
    from bebop_megatron.speculative.session import load, prompt_ids, run_config, stop_ids_of

    model, cfg = load(args.checkpoint, "cpu", handoff=args.handoff)
    spec = MegatronSpecModel(model, cfg.model.vocab_size)
    if args.gamma > spec.max_gamma():
        raise ValueError(f"--gamma {args.gamma} exceeds the checkpoint's {spec.num_steps} MTP layers")
    tokenizer = tokenizer_from_dir(cfg.data.tokenizer)
    prompts = [prompt_ids(tokenizer, p.messages) for p in prompt_set.prompts]
    progress = lambda i, n: print(f"prompt {i}/{n} done", file=sys.stderr, flush=True)  # noqa: E731
    kw = dict(gamma=args.gamma, temperature=args.temperature, mode=args.mode, max_new_tokens=args.max_new_tokens,
              seed=args.seed, stop_ids=stop_ids_of(tokenizer), baseline=args.baseline, progress=progress)
    if args.decoder == "batched":
        from bebop_megatron.speculative.batched_spec import BatchedSpecModel
        from bebop_megatron.speculative.session import run_config_batched

        batched = BatchedSpecModel(model, cfg.model.vocab_size, weight_VH=spec.weight_VH)
        result = run_config_batched(batched, spec, prompts, batch_size=args.batch_size, **kw)
    else:
        result = run_config(spec, prompts, **kw,
                            baseline_model=MegatronSpecModel(model, cfg.model.vocab_size, weight_VH=spec.weight_VH))
    result["checkpoint"] = args.checkpoint
    result["texts"] = [decode(tokenizer, t) for t in result["texts"]]
    pos = " ".join(f"{p['rate']:.3f} ({p['accepted']}/{p['attempts']})" for p in result["per_position"])
    lo, hi = result["ci95"]
    dec, (dlo, dhi) = result["predicted_accept_len_decode"], result["predicted_decode_ci95"]
    dec_text = "n/a" if dec is None else f"{dec:.3f}" + ("" if dlo is None else f" [{dlo:.3f}, {dhi:.3f}]")
    print(f"gamma={args.gamma} T={args.temperature:g} {args.mode}: accepted per verification "
          f"{result['measured_accept_len']:.3f} [{lo:.3f}, {hi:.3f}] vs decode-exact forecast {dec_text} "
          f"({result['expected_verifications']:.1f} verifications expected, {result['num_verifications']} counted); "
          f"Eq. 12 over every position {result['predicted_accept_len']:.3f}; per position {pos}; "
          f"{result['tokens_per_target_forward']:.2f} tokens per target forward; "
          f"{result['tokens_per_second']:.1f} tokens/s ({args.decoder}"
          + (f", batch {args.batch_size})" if args.decoder == "batched" else ")")
          + (f"; speed-up {result['speedup']:.2f}x" if "speedup" in result else ""))
    if args.json:
        write_json(args.json, result)
    return result


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-speculative-generate``)."""
    argv = sys.argv[1:] if argv is None else argv
    parse_args(argv)  # --help and usage errors before the library import
    from bebop_megatron.cli import run_cli

    run_cli(lambda: main(argv))


if __name__ == "__main__":
    cli()
