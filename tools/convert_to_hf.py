"""Export a Megatron checkpoint (any TP/PP/EP layout) as a Hugging Face directory that vLLM or
SGLang loads for MTP speculative decoding.

    # full model (backbone + trained MTP layers), from a training run's save.dir
    python tools/convert_to_hf.py --checkpoint checkpoints/run --backbone checkpoints/backbone \
        --format mimo --target vllm --out export/mimo_vllm
    # the draft alone
    python tools/convert_to_hf.py ... --mtp-only --out export/mimo_draft
    # DeepSeek-V3: the NextN layer as SGLang's DeepseekV3ForCausalLMNextN loads it
    python tools/convert_to_hf.py --checkpoint checkpoints/run --backbone checkpoints/dsv3 \
        --format deepseek --target sglang --mtp-only --out export/dsv3_nextn

``--format``: ``mimo`` (MiMo), ``glm4_moe`` (GLM-4.5 NextN), ``deepseek`` (DeepSeek-V3
NextN: vLLM's DeepSeekMTP, SGLang's DeepseekV3ForCausalLMNextN), ``qwen3_next`` (Qwen3-Next)
or ``qwen3_5`` (Qwen3.5 dense and MoE): top-level ``mtp.fc`` / ``mtp.pre_fc_norm_*`` /
``mtp.layers.0.*`` / ``mtp.norm`` as both engines' ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` load them.

``--checkpoint`` is a training checkpoint (``save.dir`` or one ``iter_N``; MTP weights only,
so ``--backbone`` names the model.backbone_checkpoint) or a full model checkpoint (e.g. from
convert_from_hf.py). The training checkpoint records its backbone's path and a fingerprint of
its files; another ``--backbone`` is refused (``--allow-moved-backbone``: the same files
elsewhere, checked by fingerprint alone). The source config.json and tokenizer come from
``hf/`` next to the backbone checkpoint, or ``--hf-dir``. ``--verify`` (default) reloads the
written files, checks every name and shape, and compares K draft steps
(``--num-speculative-tokens``, default the trained ``mtp.num_steps``) of an independent
pure-PyTorch MTP forward, chained as the target engine hands step k+1 its input, with the
Megatron model's, chained as the heads were trained (``mtp.next_step_input``): a mismatch
fails from step 2 on. Both engines hand on the MTP output after its final norm (vLLM's
DeepSeek-V3 / GLM-4.5 drafts since PR #45895, merged 2026-06-19); ``--vllm-handoff pre_norm``
targets those drafts in vLLM releases before it. A non-empty ``--out`` (a user's files, an earlier
export) is refused unless ``--overwrite``; an ``--out`` that is, contains or lies inside an input
directory always, and so is an ``--hf-dir`` config.json that does not describe the checkpoint's model
(vocabulary, sizes, heads, family). The logic lives in
:mod:`bebop_megatron.convert.exporter`.
"""

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="Megatron checkpoint with the MTP layers")
    p.add_argument("--backbone", default=None, help="Megatron checkpoint with the backbone (default: --checkpoint); "
                   "must be the one the heads were trained on (recorded path and fingerprint)")
    p.add_argument("--allow-moved-backbone", action="store_true",
                   help="the training run's backbone was moved or copied to --backbone: check its fingerprint only, "
                        "not its path")
    p.add_argument("--hf-dir", default=None, help="source HF config.json + tokenizer (default: BACKBONE/hf); its "
                   "vocabulary, sizes, heads and family must be the checkpoint's (refused otherwise)")
    p.add_argument("--format", required=True,
                   help="mimo | glm4_moe | deepseek (DeepSeek-V3) | qwen3_next | qwen3_5 (dense and MoE)")
    p.add_argument("--target", required=True, help="vllm | sglang (current releases: both hand draft step k+1 the "
                   "MTP output after its final norm, as mtp.next_step_input=post_norm trains)")
    p.add_argument("--vllm-handoff", default=None, metavar="post_norm|pre_norm",
                   help="what vLLM's draft hands step k+1: post_norm (default; current vLLM, every format) or "
                        "pre_norm (the DeepSeek-V3 / GLM-4.5 drafts of vLLM releases before PR #45895, merged "
                        "2026-06-19; for heads trained with mtp.next_step_input=pre_norm)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft steps to verify and to put in the printed serve command (default: the trained "
                        "mtp.num_steps); a single MTP layer is reused for every step, several need K = their number")
    p.add_argument("--out", required=True, help="output directory, apart from the inputs (one that is, contains or "
                   "lies inside --checkpoint, --backbone or --hf-dir is refused)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out (refused without it): files of the same names are replaced "
                        "and earlier *.safetensors removed; a Megatron checkpoint there is always refused")
    p.add_argument("--mtp-only", action="store_true", help="write the draft (MTP) checkpoint alone")
    p.add_argument("--round-mtp", action="store_true",
                   help="write trained float32 MTP weights in the source dtype (default: kept in float32 when the "
                        "source dtype, e.g. bf16, would round them)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check names, shapes and K steps of draft logits after writing (default: on)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="max |logits difference| relative to max(1, |logits|), > 0 (default 1e-4; float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not args.tolerance > 0 or args.tolerance == float("inf"):  # NaN fails too; checked before the export
        p.error(f"--tolerance must be a positive number, got {args.tolerance}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from bebop_megatron.convert.exporter import convert_to_hf

    convert_to_hf(args.checkpoint, args.out, args.format, args.target, backbone=args.backbone,
                  hf_dir=args.hf_dir, mtp_only=args.mtp_only, verify=args.verify, tol=args.tolerance,
                  progress=not args.no_progress, allow_moved_backbone=args.allow_moved_backbone,
                  num_steps=args.num_speculative_tokens, vllm_handoff=args.vllm_handoff,
                  overwrite=args.overwrite, round_mtp=args.round_mtp)


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-convert-to-hf``)."""
    argv = sys.argv[1:] if argv is None else argv
    from bebop_megatron.cli import run_cli

    run_cli(lambda: main(argv))


if __name__ == "__main__":
    cli()
