"""Serve an export with a real vLLM (its own venv, tools/engines/vllm_env.sh) and check it against
this project's forward: every tensor consumed, greedy outputs equal with and without MTP
speculation, vLLM's accepted drafts per position equal to the greedy replay (T=0), and its
acceptance against the decode-exact forecast (T>0). See bebop_megatron/engines/serve_check.py.

    python tools/serve_check.py --export export/mimo --num-steps 3 --temperatures 0.7 1.0 [--json]

Exit status 0 when every check held, 1 when one did not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", required=True, help="export directory of tools/convert_to_hf.py (--target vllm, full)")
    ap.add_argument("--num-steps", type=int, default=3, help="serve with K = 1..N draft tokens (default 3)")
    ap.add_argument("--temperatures", type=float, nargs="*", default=[],
                    help="temperatures besides 0 to compare with the decode-exact forecast (seeded per prompt)")
    ap.add_argument("--prompts", help="JSON file: a list of prompts, each a list of token ids "
                                      "(default: --num-prompts random prompts of --prompt-len tokens)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    ap.add_argument("--draft-sample", choices=("greedy", "probabilistic"), default="greedy",
                    help="vLLM's draft_sample_method: greedy (its default; target-only acceptance at T>0) or "
                         "probabilistic (rejection sampling)")
    ap.add_argument("--tie-tol", type=float, default=1e-3,
                    help="near-tie: top two logits (a draft's, or the target's where the outputs part) within this "
                         "times max(1, |largest logit|) (default 1e-3)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from bebop_megatron.engines import serve_check as sc

    if args.num_steps < 1 or args.max_tokens < 1 or args.num_prompts < 1 or args.prompt_len < 2:
        raise sc.ServeCheckError("--num-steps, --max-tokens and --num-prompts must be >= 1, --prompt-len >= 2")
    _, config = sc.export_format(args.export)
    if args.prompts:
        with open(args.prompts) as f:
            prompts = json.load(f)
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and len(p) >= 2 and all(
                isinstance(t, int) and 0 <= t < config["vocab_size"] for t in p) for p in prompts)):
            raise sc.ServeCheckError(f"--prompts {args.prompts}: expected a JSON list of prompts, each a list of at "
                                     f"least 2 token ids in [0, {config['vocab_size']})")
    else:
        prompts = sc.random_prompts(config["vocab_size"], args.num_prompts, args.prompt_len)
    report = sc.serve_check(args.export, prompts=prompts, max_tokens=args.max_tokens, num_steps=args.num_steps,
                            temperatures=tuple(args.temperatures), draft_sample=args.draft_sample,
                            tie_tol=args.tie_tol)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-serve-check``)."""
    argv = sys.argv[1:] if argv is None else argv
    from bebop_megatron.cli import run_cli

    run_cli(lambda: sys.exit(main(argv)))


if __name__ == "__main__":
    cli()
