"""Tokenize JSONL or Parquet files (or rollout dumps) into a Megatron indexed dataset, with the loss mask stored alongside.

    python tools/preprocess_data.py --input a.jsonl b.jsonl --output-prefix data/train \
        [--tokenizer HF_TOKENIZER_DIR] [--train-on response|all] [--on-error fail|skip] [--overwrite]

writes data/train.bin/.idx (tokens), data/train_lossmask.bin/.idx (trained flags) and
data/train_meta.json; train on it with ``data.train_files=[data/train]`` (and the same
``data.tokenizer``). A dataset already at the prefix is replaced only with --overwrite (a
run that trained on it then refuses to resume: checkpoints record the data's fingerprint).
The logic lives in :mod:`bebop_megatron.data.preprocess`.
"""

import argparse
import sys

from bebop_megatron.config.layouts import FORMATS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="JSONL lines / Parquet rows: {\"messages\": [{\"role\", \"content\"}, ...]}, {\"prompt\", \"response\"}, "
        "{\"text\"},\n{\"input_ids\", \"loss_mask\" or \"labels\"} or {\"prompt_ids\", \"response_ids\"} (ids below the "
        "tokenizer's vocab_size: give\n--tokenizer of the model they come from). Bad lines stop the run with PATH:LINE: ... "
        "(exit status 2)\nunless --on-error skip.",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="input JSONL, Parquet (pip install 'bebop_megatron[parquet]') or slime .pt files, in order")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="layout of the records (as data.format; default auto: detected per file)")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="writes PREFIX.bin/.idx, PREFIX_lossmask.bin/.idx and PREFIX_meta.json")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="local Hugging Face tokenizer directory (default: the built-in byte tokenizer)")
    parser.add_argument("--train-on", choices=("response", "all"), default="response",
                        help="tokens the stored loss mask marks as trained (default: response)")
    parser.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                        help="bad lines: stop with PATH:LINE (fail, default) or skip and report counts")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a dataset already at --output-prefix (default: refuse); an --input among "
                             "its files is refused even with it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from bebop_megatron.data.preprocess import preprocess

    preprocess(args.input, args.output_prefix, tokenizer_dir=args.tokenizer, train_on=args.train_on,
               on_error=args.on_error, progress=not args.no_progress, overwrite=args.overwrite,
               data_format=args.format)


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-preprocess-data``)."""
    argv = sys.argv[1:] if argv is None else argv
    parse_args(argv)  # --help and usage errors before the library (and torch) import
    from bebop_megatron.cli import run_cli

    run_cli(lambda: main(argv))


if __name__ == "__main__":
    cli()
