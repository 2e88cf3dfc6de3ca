"""Convert a Hugging Face model directory into a Megatron distributed checkpoint.

    python tools/convert_from_hf.py --hf-dir HF_MODEL_DIR --out checkpoints/backbone \
        [--mtp-num-steps K] [--mtp-init random|copy_last_layer] [--max-tensor-parallel 8]

Families: Llama, Qwen2, Qwen3 (dense), Qwen3-MoE, MiMo, GLM-4.5-style MoE, DeepSeek-V3
(Multi-Latent Attention, plain RoPE or YaRN), Qwen3-Next and Qwen3.5 dense / MoE (Gated
DeltaNet hybrids; ``Qwen3_5ForCausalLM`` or the multimodal ``Qwen3_5ForConditionalGeneration``,
whose vision tower is kept in ``OUT/hf/vision.safetensors``). MiMo's, GLM's, DeepSeek's and
Qwen's (``mtp.*``) MTP layers are imported.
The checkpoint loads at any TP/PP/EP layout (TP must divide --max-tensor-parallel, which
sets the vocabulary padding); train with ``model.backbone_checkpoint=OUT`` plus the
``model``/``mtp`` sections written to ``OUT/bebop_model.yaml``. A checkpoint already at ``OUT`` (a
training run's ``iter_N``, an earlier import) is replaced only with ``--overwrite``. The tokenizer and source
config are copied to ``OUT/hf``; ``bebop_model.yaml`` then also sets ``data.tokenizer`` to it. The logic lives in :mod:`bebop_megatron.convert.importer`.
"""

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json, *.safetensors)")
    p.add_argument("--out", required=True, help="output Megatron distributed checkpoint directory")
    p.add_argument("--mtp-num-steps", type=int, default=None,
                   help="MTP steps K of the training config: train as many as the heads will draft when served "
                        "(default: the checkpoint's MTP layers when it has several, otherwise 3, one layer reused; "
                        ">= 1)")
    p.add_argument("--mtp-init", choices=("random", "copy_last_layer"), default="random",
                   help="MTP layers of a model without them: Megatron's random init, or the last "
                        "backbone layer (and final norm) copied into the MTP decoder layer")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times the TP size (default 128; >= 1)")
    p.add_argument("--max-tensor-parallel", type=int, default=8,
                   help="pad the vocabulary so every TP dividing this loads the checkpoint (default 8; >= 1)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a Megatron checkpoint already at --out (a training run's iter_N or an earlier "
                        "import; refused without it); any other non-empty --out is always refused")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("mtp_num_steps", "make_vocab_size_divisible_by", "max_tensor_parallel"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from bebop_megatron.convert.importer import convert_from_hf

    convert_from_hf(args.hf_dir, args.out, mtp_num_steps=args.mtp_num_steps, mtp_init=args.mtp_init,
                    make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                    max_tensor_parallel=args.max_tensor_parallel, progress=not args.no_progress,
                    overwrite=args.overwrite)


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-convert-from-hf``)."""
    argv = sys.argv[1:] if argv is None else argv
    from bebop_megatron.cli import run_cli

    run_cli(lambda: main(argv))


if __name__ == "__main__":
    cli()
