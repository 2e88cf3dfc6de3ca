"""Frozen-backbone training steps of a ~1B random dense model: tokens/s, MFU, peak memory.

    python benchmarks/gpu/bench_train_step.py                         # one GPU, bf16, 1.43B parameters
    python benchmarks/gpu/bench_train_step.py --device cpu --precision fp32 --layers 2 --hidden 64 \\
        --ffn 128 --heads 4 --groups 2 --vocab 256 --seq 32 --steps 3 --warmup 1    # the dry run's size

Default model (random weights, local layer spec, no Transformer Engine): 16 layers, hidden
2048, FFN 5632 (SwiGLU), 16 heads, 8 query groups, vocabulary 151,936 (untied output
layer): 1.43B parameters, 55.6M of them the trainable MTP layer; one MTP layer applied K=3 times, e2e TV loss; sequence 4096, micro-batch
1, global batch 8 (8 micro-batches per step, synthetic data), one rank. ``Trainer.train()``
runs ``--warmup + --steps`` steps and its own accounting gives the numbers (model FLOPs from
``training/flops.py``, MFU against the GPU's dense bf16 peak, ``torch.cuda.max_memory_allocated``);
reported: the median over the ``--steps`` steps after ``--warmup``. Rows go to
``results.csv`` (or ``$BENCH_RESULTS_CSV``) with the GPU's name in the ``machine`` column.

``--variants unfused:1,sdpa:1,sdpa:4`` measures several ``model.attention_backend`` /
micro-batch pairs one after the other in this process (same model, data and step count; the
global batch stays ``--global-batch``), so a before/after comparison comes from one run; a
variant that runs out of GPU memory is reported as such and the others still run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import append_results, device_label  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--attention", choices=("sdpa", "unfused"), default="sdpa", help="model.attention_backend")
    p.add_argument("--variants", default=None,
                   help="comma-separated ATTENTION:MICRO_BATCH pairs measured in turn (overrides --attention and "
                        "--micro-batch), e.g. unfused:1,sdpa:1,sdpa:4")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--loss", default="e2e_tv")
    p.add_argument("--steps", type=int, default=6, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    variants = [(args.attention, args.micro_batch)]
    if args.variants:
        try:
            variants = [(a, int(m)) for a, m in (v.split(":") for v in args.variants.split(","))]
        except ValueError:
            p.error(f"--variants {args.variants!r}: expected ATTENTION:MICRO_BATCH pairs, e.g. unfused:1,sdpa:4")
        if any(a not in ("sdpa", "unfused") or m < 1 or args.global_batch % m for a, m in variants):
            p.error(f"--variants {args.variants!r}: attention sdpa or unfused, micro-batch >= 1 dividing "
                    f"--global-batch {args.global_batch}")
    failed = 0
    for attention, micro in variants:
        failed += not measure(args, attention, micro)
    sys.exit(failed)


def measure(args, attention: str, micro: int) -> bool:
    """One variant: build, train, print, append rows; False when it ran out of GPU memory."""
    import gc

    import torch

    from bebop_megatron.config import load_config
    from bebop_megatron.training import Trainer

    t0 = time.perf_counter()
    cfg = load_config(overrides=[
        f"device={args.device}", f"precision={args.precision}", "model.transformer_impl=local",
        "save.dir=null", "train.resume=none", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.ffn_hidden_size={args.ffn}", f"model.num_attention_heads={args.heads}",
        f"model.num_query_groups={args.groups}", f"model.vocab_size={args.vocab}",
        f"model.max_position_embeddings={max(args.seq, 4096)}", "mtp.num_layers=1", "mtp.num_steps=3",
        f"model.attention_backend={attention}",
        f"loss.type={args.loss}", f"train.seq_length={args.seq}", f"train.micro_batch_size={micro}",
        f"train.global_batch_size={args.global_batch}", f"train.steps={args.warmup + args.steps}",
        f"train.log_interval={args.warmup + args.steps}", f"data.num_samples={args.global_batch * (args.warmup + args.steps)}",
    ])
    label = device_label(args.device)
    try:
        trainer = Trainer(cfg, log=lambda *a, **k: None)
        built = time.perf_counter() - t0
        total = sum(q.numel() for q in trainer.model.module.parameters())
        trainable = sum(q.numel() for q in trainer.model.module.parameters() if q.requires_grad)
        history = trainer.train()[args.warmup:]
    except torch.OutOfMemoryError:
        print(f"{label}: attention {attention}, micro-batch {micro}: out of GPU memory")
        return False
    finally:
        trainer = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    tok_s = statistics.median(m.tokens_per_s for m in history)
    mfus = [m.extra["mfu"] for m in history if m.extra.get("mfu") is not None]
    mfu = statistics.median(mfus) if mfus else float("nan")
    peak_gib = max(m.extra.get("peak_mem_gib") or 0.0 for m in history)
    print(f"{label}: {total / 1e6:,.1f}M parameters ({trainable / 1e6:.2f}M trainable MTP), {args.precision}, "
          f"seq {args.seq} x global batch {args.global_batch} (micro-batch {micro}), attention {attention}, "
          f"loss {args.loss}, "
          f"built in {built:.0f} s")
    print(f"median of {len(history)} steps after {args.warmup} warm-up: {tok_s:,.0f} tokens/s, MFU {mfu:.1%}, "
          f"peak memory {peak_gib:.2f} GiB, loss {history[-1].loss:.4f}")
    append_results(
        "bench_train_step", args.device,
        {"params_m": round(total / 1e6, 1), "layers": args.layers, "hidden": args.hidden, "seq": args.seq,
         "global_batch": args.global_batch, "micro_batch": micro, "precision": args.precision,
         "loss": args.loss, "spec": "local", "attention": attention},
        {"tokens_per_s": tok_s, "mfu": mfu, "peak_mem_gib": peak_gib, "build_s": built},
        torch.__version__, machine_extra=label,
    )
    return True


if __name__ == "__main__":
    main()
