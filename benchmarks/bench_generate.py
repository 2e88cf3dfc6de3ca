r"""Generation throughput: the project's batched sampler over the Megatron model
(``tools/generate_responses.py --megatron``) against transformers' ``generate`` (HFBackend,
``--hf-dir``), side by side in one run on the same model, prompts, seeds and sampler.

    .venv/bin/python benchmarks/bench_generate.py                       # tiny random Llama, CPU, seconds
    python benchmarks/bench_generate.py --device cuda --shape smollm2   # SmolLM2-135M's shape, random weights
    python benchmarks/bench_generate.py --device cuda --hf-dir ~/.cache/bebop_megatron/smollm2-135m/hf

Each variant (``hf``, ``megatron``, and on CUDA ``megatron_graphs``) builds its backend, runs
one warm-up batch (graph capture included), then generates every prompt ``--repeats`` times
in rounds (variant after variant, so load changes hit all alike); reported: generated tokens
per second (the tokens kept: up to and including each row's EOS, as written to the output),
the median over rounds, and megatron / hf. ``agree``: the share of samples whose
``response_ids`` equal HFBackend's (1 in fp32 unless a uniform falls within rounding of a
token boundary; lower in bf16, where the kernels' rounding differs). A random model
(``--shape``) rarely samples its EOS: its rows run to ``--max-new-tokens``. Rows are appended
to ``benchmarks/results.csv`` (``$BENCH_RESULTS_CSV`` when set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, device_label  # noqa: E402

SHAPES = {  # LlamaConfig fields
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
WORDS = ("the cat sat on a mat and the dog ran far away while two birds sang about time stories numbers "
         "rivers mountains code tests models tokens").split()


def random_model(shape: str, path: Path) -> Path:
    """A random Llama of ``shape`` with a word-level tokenizer of its whole vocabulary (words
    ``w<i>`` after the real ones) and a chat template: what HFBackend and --megatron load."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = SHAPES[shape]
    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    words = specials + WORDS + [f"w{i}" for i in range(cfg["vocab_size"] - len(specials) - len(WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                     eos_token="<|im_end|>", additional_special_tokens=specials[2:])
    hf_tok.chat_template = TEMPLATE
    hf_tok.save_pretrained(str(path))
    torch.manual_seed(0)
    config = LlamaConfig(**cfg, max_position_embeddings=4096, eos_token_id=3, pad_token_id=1, bos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def prompts(num: int, min_words: int, max_words: int, seed: int) -> list:
    """Synthetic one-message prompts of ``min_words..max_words`` words."""
    import random

    from bebop_megatron.data.generate import Prompt

    rng = random.Random(seed)
    out = []
    for i in range(num):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        out.append(Prompt(f"p{i}", [{"role": "user", "content": f"{text} ?"}], {}, i + 1))
    return out


def model_label(hf_dir: str, args) -> str:
    """``random_<shape>`` or the directory's name with its config's shape (the ``model`` param)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    shape = f"{c.get('model_type')}_h{c.get('hidden_size')}_l{c.get('num_hidden_layers')}"
    if not args.hf_dir:
        return f"random_{args.shape}:{shape}"
    path = os.path.abspath(args.hf_dir.rstrip("/"))
    name = os.path.basename(path)
    return f"{os.path.basename(os.path.dirname(path)) if name == 'hf' else name}:{shape}"


def make_backend(variant: str, hf_dir: str, args):
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
              batch_size=args.batch_size, device=args.device, dtype=args.dtype, threads=args.threads)
    if variant == "hf":
        from bebop_megatron.data.generate_hf import HFBackend

        return HFBackend(hf_dir, **kw)
    from bebop_megatron.speculative.generate_backend import MegatronBackend

    return MegatronBackend(hf_dir, cuda_graphs=variant == "megatron_graphs", **kw)


def run(backend, jobs) -> tuple[float, dict]:
    """Seconds and ``{(prompt, sample): response_ids}`` of one pass over ``jobs``."""
    import torch

    from bebop_megatron.data.generate import Completion

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = {}
    for job, result in backend.generate(jobs):
        if not isinstance(result, Completion):
            sys.exit(f"error: {job.prompt.id}: {result.message}")
        out[(job.prompt.key, job.sample)] = result.response_ids
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", default=None, help="a Hugging Face model directory (default: a random --shape model)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny", help="the random model's shape (default tiny)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="default: bf16 on CUDA, else fp32")
    p.add_argument("--variants", default=None,
                   help="comma-separated of hf, megatron, megatron_graphs (default: all three on CUDA, the first two "
                        "on the CPU)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompt-words", default="4,40", metavar="MIN,MAX", help="prompt lengths in words (default 4,40)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1, help="timed rounds (median reported; default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    variants = (args.variants or ("hf,megatron,megatron_graphs" if args.device == "cuda" else "hf,megatron")).split(",")
    unknown = set(variants) - {"hf", "megatron", "megatron_graphs"}
    if unknown or "hf" not in variants:
        p.error(f"--variants: hf plus any of megatron, megatron_graphs (got {args.variants})")
    if "megatron_graphs" in variants and args.device != "cuda":
        p.error("megatron_graphs needs --device cuda")
    lo, hi = (int(x) for x in args.prompt_words.split(","))

    import torch

    from bebop_megatron.data.generate import plan_jobs

    tmp = tempfile.TemporaryDirectory()
    hf_dir = args.hf_dir or str(random_model(args.shape, Path(tmp.name)))
    jobs = plan_jobs(prompts(args.num_prompts, lo, hi, args.seed), 1, args.seed, set())
    backends, load_s = {}, {}
    for v in variants:
        t0 = time.perf_counter()
        backends[v] = make_backend(v, hf_dir, args)
        load_s[v] = time.perf_counter() - t0
    # Shortest prompts together (less padding), the same order for every variant, as the study sorts.
    jobs.sort(key=lambda job: len(backends["hf"].prompt_ids(job)))
    for v in variants:  # warm-up: one batch (kernels, allocator, CUDA-graph capture)
        run(backends[v], jobs[: args.batch_size])
    seconds = {v: [] for v in variants}
    ids = {}
    for _ in range(args.repeats):
        for v in variants:
            s, ids[v] = run(backends[v], jobs)
            seconds[v].append(s)
    metrics, params = {}, dict(model=model_label(hf_dir, args), dtype=args.dtype, batch=args.batch_size,
                               prompts=args.num_prompts, max_new=args.max_new_tokens, temperature=args.temperature,
                               top_p=args.top_p, repeats=args.repeats)
    print(f"{'variant':>16} {'tokens':>8} {'seconds':>9} {'tokens/s':>10} {'load s':>7} {'agree':>6}")
    for v in variants:
        tokens = sum(len(r) for r in ids[v].values())
        sec = statistics.median(seconds[v])
        agree = sum(ids[v][k] == ids["hf"][k] for k in ids["hf"]) / len(ids["hf"])
        metrics[f"{v}_tokens_per_s"] = tokens / sec
        metrics[f"{v}_tokens"] = tokens
        metrics[f"{v}_load_s"] = load_s[v]
        if v != "hf":
            metrics[f"{v}_agree"] = agree
        print(f"{v:>16} {tokens:>8} {sec:>9.3f} {tokens / sec:>10.1f} {load_s[v]:>7.1f} {agree:>6.3f}")
    for v in variants[1:]:
        metrics[f"{v}_over_hf"] = metrics[f"{v}_tokens_per_s"] / metrics["hf_tokens_per_s"]
        print(f"{v} / hf: {metrics[f'{v}_over_hf']:.2f}x")
    append_results("bench_generate", args.device, params, metrics, torch.__version__,
                   machine_extra=device_label(args.device))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))


if __name__ == "__main__":
    main()
