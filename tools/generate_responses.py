r"""On-policy chat data: sample the model's own responses to a prompts file, as trainable JSONL.

    # a vLLM / SGLang server (OpenAI-compatible), e.g. `vllm serve Qwen/Qwen3-8B --port 8000`
    python tools/generate_responses.py --prompts prompts.jsonl --out onpolicy.jsonl \
        --endpoint http://localhost:8000 --n 4 --temperature 1.0 --max-new-tokens 4096 --concurrency 64

    # local Hugging Face weights with transformers (small models, or no server at hand)
    python tools/generate_responses.py --prompts prompts.jsonl --out onpolicy.jsonl \
        --hf-dir /models/Qwen3-0.6B --batch-size 16 --max-new-tokens 1024 --seed 0

    # the project's own batched sampler over the Megatron model (an import of
    # tools/convert_from_hf.py, or a Hugging Face directory imported in memory); GQA models, dense or MoE
    python tools/generate_responses.py --prompts prompts.jsonl --out onpolicy.jsonl \
        --megatron checkpoints/backbone --batch-size 64 --max-new-tokens 1024 --seed 0

Prompt lines: {"id": ..., "prompt": "text"} or {"id": ..., "messages": [{"role": "user",
"content": ...}, ...]}; "id" is optional (default: a hash of the messages) and other fields
(e.g. "source") are copied to the output; a data line's answer (a "response" field, a last
message from the assistant) is refused: the output could not train. Each output line is one sample,
{"id", "sample", "messages": [...prompt, {"role": "assistant", "content"}], "prompt_ids",
"response_ids", "finish_reason", "num_tokens", ...}, which trains as is: data.train_files=[onpolicy.jsonl]
with the same model's tokenizer as data.tokenizer. "prompt_ids"/"response_ids" are the ids the model
was given and sampled (always with --hf-dir and --megatron; from an --endpoint that returns them, as vLLM does for
"return_token_ids", else one warning and text only); training uses them instead of the text.

Run the same command again to resume: samples already in --out are skipped (a truncated
last line from an interrupted write is cut away), and every sample is appended and flushed
as soon as it is done, so Ctrl-C (exit status 130) loses nothing finished. The sampling
settings (the model, --temperature, --top-p, --max-new-tokens, --seed) are recorded in
<out>.settings.json: a resume with other ones is refused, naming them. One run writes an
--out at a time: it holds <out>.lock (as training holds save.dir/run.lock), and a second run
on the same --out is refused, naming the first; a lock whose run is gone is taken over.
Identical prompts are generated once; empty responses (and, with --dedupe-responses,
repeated ones) are not written. A sample that fails (endpoint errors after --retries) prints one `error:` line;
the others go on, and the exit status is 1 if any failed (rerun to retry them); bad
arguments or a malformed prompt line stop the run with exit status 2.

Seeds: sample j of prompt ID uses a seed derived from (--seed, ID, j) only. With --hf-dir
or --megatron (the same sampler) the text is the same for any --batch-size, order or resume
as long as the logits are (in fp32 they practically always are; see
bebop_megatron/data/generate_hf.py); with
--endpoint the seed is sent with the request (vLLM and SGLang honour it). Models with a
reasoning parser: serve without it, so that the thinking stays in the message content.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[1:]))
    parser.add_argument("--prompts", required=True, metavar="FILE", help="prompts JSONL")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="output JSONL (its directory must exist; appended to; resumed if present); one run at a "
                             "time (<out>.lock)")
    backend = parser.add_argument_group("backend (exactly one)")
    backend.add_argument("--hf-dir", metavar="DIR", help="local Hugging Face model directory (transformers)")
    backend.add_argument("--megatron", metavar="DIR",
                         help="the project's batched sampler over the Megatron model: an import of "
                              "tools/convert_from_hf.py, or a Hugging Face directory imported in memory (GQA/MHA "
                              "models with RoPE, dense or MoE, at TP=1; refused: MLA, Gated DeltaNet)")
    backend.add_argument("--endpoint", metavar="URL",
                         help="OpenAI-compatible server, e.g. http://localhost:8000 (with or without /v1)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=1.0, metavar="T", help="default 1.0 (0: greedy)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="nucleus mass in (0, 1] (default 1.0: off)")
    sampling.add_argument("--max-new-tokens", type=int, default=1024, metavar="N", help="per response (default 1024)")
    sampling.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    sampling.add_argument("--seed", type=int, default=0, metavar="S", help="run seed (default 0)")
    sampling.add_argument("--limit", type=int, default=None, metavar="N",
                          help="only the first N distinct prompts of the file")
    sampling.add_argument("--dedupe-responses", action="store_true",
                          help="drop a sample whose response equals an earlier sample of the same prompt")
    hf = parser.add_argument_group("--hf-dir / --megatron options")
    hf.add_argument("--batch-size", type=int, default=8, metavar="B", help="samples per generate() call (default 8)")
    hf.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    hf.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                    help="default auto: bf16 on CUDA, fp32 on CPU")
    hf.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's)")
    hf.add_argument("--cuda-graphs", action="store_true",
                    help="--megatron on CUDA: replay the decode step as a CUDA graph (never run yet: written "
                         "without a GPU)")
    ep = parser.add_argument_group("--endpoint options")
    ep.add_argument("--model", default=None, metavar="NAME",
                    help="model name to request (default: the first of GET /v1/models)")
    ep.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), metavar="KEY",
                    help="bearer token (default: $OPENAI_API_KEY, if set)")
    ep.add_argument("--concurrency", type=int, default=16, metavar="N", help="requests in flight (default 16)")
    ep.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                    help="seconds per request attempt (default 600)")
    ep.add_argument("--retries", type=int, default=3, metavar="N",
                    help="retries after a connection error, timeout, HTTP 429 or 5xx (default 3)")
    ep.add_argument("--backoff", type=float, default=1.0, metavar="SECONDS",
                    help="first retry delay in seconds, doubled per retry up to 60 (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def megatron_kind(path: str) -> str | None:
    """What a Megatron checkpoint directory is (plain file checks), or None."""
    if os.path.isfile(os.path.join(path, "bebop_model.yaml")):  # convert.importer's record
        return "a Megatron checkpoint imported by tools/convert_from_hf.py"
    if os.path.isfile(os.path.join(path, "latest")) or os.path.isfile(os.path.join(path, "metadata.json")):
        return "a Megatron checkpoint (a training run's save.dir or iter_N)"
    return None


def check_args(args: argparse.Namespace) -> None:
    """Semantic checks, as ``ValueError`` (one ``error:`` line, exit status 2)."""
    given = [name for name in ("hf_dir", "megatron", "endpoint") if getattr(args, name) is not None]
    if len(given) != 1:
        raise ValueError("pass exactly one backend: --hf-dir DIR, --megatron DIR or --endpoint URL"
                         + (f" (got {' and '.join('--' + g.replace('_', '-') for g in given)})" if given else ""))
    for name in ("hf_dir", "megatron"):
        if getattr(args, name) is not None and not os.path.isdir(getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: not a directory")
    if args.cuda_graphs and (args.megatron is None or args.device != "cuda"):
        raise ValueError("--cuda-graphs needs --megatron and --device cuda")
    if args.hf_dir is not None:  # transformers would suggest installing sentencepiece
        megatron = megatron_kind(args.hf_dir)
        if megatron:
            raise ValueError(f"--hf-dir {args.hf_dir} is {megatron}, not a Hugging Face model directory (config.json "
                             "and *.safetensors): pass it as --megatron, or the Hugging Face model, e.g. the --hf-dir it "
                             "was imported from, or serve the model and pass --endpoint")
    if not os.path.isfile(args.prompts):
        raise ValueError(f"--prompts {args.prompts}: file not found")
    from bebop_megatron.cli import check_output_file

    check_output_file(args.out, "--out")  # a directory, or one in a directory that does not exist
    if os.path.exists(args.out) and os.path.samefile(args.prompts, args.out):
        raise ValueError("--out is the prompts file")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    for name in ("max_new_tokens", "n", "limit", "batch_size", "threads", "concurrency"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.timeout > 0 or args.retries < 0 or args.backoff < 0:
        raise ValueError("--timeout must be > 0, --retries and --backoff >= 0")


def main(argv=None) -> int:
    """Exit status: 0, or 1 when some samples failed; raises ``ValueError`` on user errors."""
    args = parse_args(argv)
    check_args(args)
    from bebop_megatron.cli import output_write_error
    from bebop_megatron.training import lock

    # Two runs appending to one --out would each generate (and write) the samples the other has not
    # written yet: one run per --out, as one training run per save.dir.
    lock_path = f"{args.out}.lock"
    try:  # the first write: a read-only file system or a full disk stops the run here
        notice = lock.acquire_file(lock_path, f"--out {args.out}", "--out", "file")
    except OSError as err:
        raise output_write_error(err, "--out", args.out) from None
    if notice:
        print(notice, file=sys.stderr)
    try:
        return _generate(args)
    finally:
        lock.release(lock_path, lock.this_run())


def _generate(args: argparse.Namespace) -> int:
    from bebop_megatron.data.generate import (check_settings, load_existing, plan_jobs, read_prompts, run_generation,
                                              write_settings)

    prompt_set = read_prompts(args.prompts, args.limit)
    existing = load_existing(args.out, track_responses=args.dedupe_responses)
    jobs = plan_jobs(prompt_set.prompts, args.n, args.seed, existing.done)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    backend = None
    if args.endpoint is not None:  # the model's name may come from the server (one request)
        from bebop_megatron.data.generate_endpoint import EndpointBackend

        backend = EndpointBackend(args.endpoint, model=args.model, api_key=args.api_key, concurrency=args.concurrency,
                                  timeout=args.timeout, retries=args.retries, backoff=args.backoff, **sampling)
    if backend is not None:
        model = f"endpoint {backend.model}"
    elif args.megatron is not None:  # other kernels than transformers': other logits at the rounding level
        model = f"megatron {os.path.realpath(args.megatron)}"
    else:
        model = f"hf-dir {os.path.realpath(args.hf_dir)}"
    settings = {"model": model, **sampling, "seed": args.seed}
    check_settings(args.out, settings, existing.num_lines)  # samples made otherwise are not "done"
    print(f"{len(prompt_set.prompts)} prompts ({prompt_set.num_duplicates} duplicate prompts dropped) x {args.n} "
          f"samples: {len(jobs)} to generate, {len(prompt_set.prompts) * args.n - len(jobs)} already in {args.out}"
          + (" (a truncated last line was cut away)" if existing.truncated else ""), file=sys.stderr)
    if not jobs:
        return 0
    try:
        write_settings(args.out, settings)
    except OSError as err:
        from bebop_megatron.cli import output_write_error

        raise output_write_error(err, "--out", args.out) from None
    if backend is None and args.megatron is not None:
        from bebop_megatron.speculative.generate_backend import MegatronBackend

        backend = MegatronBackend(args.megatron, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                                  threads=args.threads, cuda_graphs=args.cuda_graphs, **sampling)
    if backend is None:
        from bebop_megatron.data.generate_hf import HFBackend

        backend = HFBackend(args.hf_dir, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                            threads=args.threads, **sampling)
    summary = run_generation(backend, jobs, args.out, existing, dedupe_responses=args.dedupe_responses,
                             progress=not args.no_progress)
    print(summary.line(args.out))
    return 1 if summary.num_failed else 0


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-generate-responses``)."""
    argv = sys.argv[1:] if argv is None else argv
    parse_args(argv)  # --help and usage errors before the library (and torch) import
    from bebop_megatron.cli import run_cli

    run_cli(lambda: sys.exit(main(argv)))


if __name__ == "__main__":
    cli()
