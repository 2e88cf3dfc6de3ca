r"""Speculative decoding throughput: the single-sequence decoder (``--decoder single`` of
``tools/speculative_generate.py``) against the batched one (``--decoder batched``), side by side
in one run on the same model, prompts, seeds and settings; optionally vLLM's CPU engine on the
same prompts (``--vllm``, in the engine venv of ``tools/engines/vllm_env.sh``).

    .venv/bin/python benchmarks/bench_speculative_decode.py              # tiny random MTP model, seconds
    .venv/bin/python benchmarks/bench_speculative_decode.py --hf-dir ~/.cache/bebop_megatron/smollm2-135m/hf \
        --vllm --vllm-venv .venv-vllm

Variants (each decodes every prompt once per round; rounds go variant after variant, so a
change of machine load hits all alike; reported: the median over ``--repeats`` rounds):

- ``single``: speculative decoding one prompt at a time (MegatronSpecModel, per-layer caches);
- ``batched``: the same prompts ``--batch-size`` at a time (BatchedSpecModel, static caches);
- ``batched_plain``: the batched decoder without drafts (one target forward per token);
- ``vllm_plain`` (``--vllm``, needs ``--hf-dir``): vLLM's ``LLM.generate`` on the HF folder, no
  speculation, in one worker process kept alive between rounds (its model load is not timed);
- ``vllm_spec`` (``--vllm-spec``, ``--hf-dir`` an export with MTP layers, e.g. ``--format mimo
  --target vllm`` of tools/convert_to_hf.py): the same with MTP speculation, ``--gamma`` draft
  tokens, ``draft_sample_method: probabilistic`` (rejection sampling with the draft's
  distribution, as ours), in a second worker. vLLM 0.32's CPU fallback of the rejection
  sampler's ``expand_batch_to_tokens`` leaves the per-token temperatures uninitialised at T > 0;
  the worker replaces it with the same expansion in torch.

Every variant samples at ``--temperature`` (RS at gamma ``--gamma`` for the speculative ones)
and generates exactly ``--max-new-tokens`` per prompt (no stop token; vLLM with
``ignore_eos``), so the tokens counted are the same; tokens/s = generated tokens over the
wall time of the whole decoding, prefill included. ``agree``: the share of prompts on which
``batched`` gave ``single``'s tokens (same seeds; 1 unless batched float rounding moves a
sample). The model: with ``--hf-dir`` the HF folder imported in memory (fp32) with
``--mtp-init`` MTP layers (``copy_last_layer`` by default: untrained, so few drafts are
accepted; the acceptance is printed), else a tiny random MTP model. Threads: ``--threads`` for
torch here and OMP_NUM_THREADS for vLLM (with VLLM_CPU_OMP_THREADS_BIND=nobind, so that it
uses the same number of threads instead of binding one per core). Rows are
appended to ``benchmarks/results.csv`` (``$BENCH_RESULTS_CSV`` when set) with the 1-minute load
average before and after the run (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results  # noqa: E402

CHAT = ["What is the capital of France?", "Write a haiku about rain.", "Explain what a prime number is.",
        "Give me three tips for learning to cook.", "Why is the sky blue?", "Summarize the plot of Cinderella.",
        "How do I reverse a list in Python?", "What is 17 times 23?", "Name four planets of the solar system.",
        "Describe a cat to someone who has never seen one.", "What causes the seasons on Earth?",
        "Translate 'good morning' into Spanish and French.", "What is photosynthesis?",
        "Suggest a name for a friendly robot.", "How many days are in a leap year?",
        "Write two sentences about the ocean."]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", default=None, help="a Hugging Face model folder (default: a tiny random MTP model)")
    p.add_argument("--mtp-init", default="copy_last_layer", choices=("copy_last_layer", "random"),
                   help="the MTP layers of --hf-dir's import (the folder has none)")
    p.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--gamma", type=int, default=3, help="drafts per verification (default 3)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--batch-size", type=int, default=16, help="rows of the batched decoder (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads here, OMP_NUM_THREADS for vLLM (default 1: on a shared machine a second "
                        "thread waits at every barrier for a descheduled one)")
    p.add_argument("--skip-single", action="store_true", help="leave out the (slow) single-sequence variant")
    p.add_argument("--vllm", action="store_true", help="add vLLM's CPU engine (needs --hf-dir and the engine venv)")
    p.add_argument("--vllm-spec", action="store_true",
                   help="add vLLM with MTP speculation (--hf-dir must hold MTP layers: a MiMo export)")
    p.add_argument("--vllm-venv", default=os.environ.get("BEBOP_VLLM_VENV", ".venv-vllm"),
                   help="the engine venv (default $BEBOP_VLLM_VENV or .venv-vllm)")
    p.add_argument("--no-csv", action="store_true", help="do not append to results.csv")
    p.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "gamma", "batch_size", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.temperature > 0:
        p.error("--temperature must be > 0 (the single-sequence decoder samples)")
    if (args.vllm or args.vllm_spec) and not args.hf_dir:
        p.error("--vllm needs --hf-dir (vLLM loads a Hugging Face folder)")
    if (args.vllm or args.vllm_spec) and not os.path.isfile(os.path.join(args.vllm_venv, "bin", "python")):
        p.error(f"--vllm: no engine venv at {args.vllm_venv} (make it with tools/engines/vllm_env.sh)")
    if args.hf_dir and not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        p.error(f"--hf-dir {args.hf_dir}: no config.json")
    return args


# ---------------------------------------------------------------------------- vLLM worker (engine venv)

def vllm_worker(request_path: str) -> None:
    """In the engine venv: load the model once, then one timed ``generate`` per ``go`` line on
    stdin, one JSON line back each."""
    with open(request_path) as f:
        req = json.load(f)
    from vllm import LLM, SamplingParams

    kw = {}
    if req["gamma"]:
        import torch
        from vllm.v1.sample import rejection_sampler

        def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
            src = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
            return torch.repeat_interleave(src, counts, output_size=num_tokens)

        rejection_sampler.expand_batch_to_tokens = expand
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": req["gamma"],
                                    "draft_sample_method": "probabilistic"}
    llm = LLM(model=req["model"], dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=req["max_model_len"], seed=0, gpu_memory_utilization=0.1, trust_remote_code=True, **kw)
    params = SamplingParams(temperature=req["temperature"], max_tokens=req["max_new_tokens"], ignore_eos=True,
                            detokenize=False, seed=req["seed"])
    prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"seconds": wall, "tokens": tokens}), flush=True)


class VLLM:
    def __init__(self, args, prompts, tmp: Path, gamma: int = 0):
        req = tmp / f"vllm_request_{gamma}.json"
        req.write_text(json.dumps({"model": os.path.abspath(args.hf_dir), "prompts": prompts, "gamma": gamma,
                                   "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                   "seed": 0, "max_model_len": max(map(len, prompts)) + args.max_new_tokens + 8}))
        venv = os.path.abspath(args.vllm_venv)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"), OMP_NUM_THREADS=str(args.threads),
                   VLLM_CPU_OMP_THREADS_BIND="nobind")
        iomp = os.path.join(venv, "lib", "libiomp5.so")
        if os.path.isfile(iomp):
            env["LD_PRELOAD"] = iomp
        self.log = open(tmp / f"vllm_{gamma}.log", "w")
        self.proc = subprocess.Popen([os.path.join(venv, "bin", "python"), os.path.abspath(__file__),
                                      "--vllm-worker", str(req)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=str(tmp))
        self._expect("READY")

    def _expect(self, word):
        for line in self.proc.stdout:
            if line.startswith(word):
                return line[len(word):].strip()
        self.log.flush()
        raise SystemExit(f"error: the vLLM worker ended before {word}; its log: {self.log.name}")

    def run(self) -> tuple[int, float]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        r = json.loads(self._expect("RESULT"))
        return r["tokens"], r["seconds"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


# ---------------------------------------------------------------------------- our decoders

def tiny_model():
    import torch

    from bebop_megatron.config import load_config
    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.parallel import setup_parallel

    init_distributed("cpu")
    cfg = load_config(overrides=["device=cpu", "save.dir=null", "train.resume=none", "model.num_layers=2",
                                 "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
                                 "model.num_query_groups=2", "model.vocab_size=512", "mtp.num_steps=3",
                                 "mtp.num_layers=3"])
    setup_parallel(cfg, 1)
    torch.manual_seed(0)
    return build_model(cfg, "cpu").eval(), 512


def real_model(args):
    from bebop_megatron.convert.importer import load_hf_model

    imported = load_hf_model(args.hf_dir, mtp_num_steps=args.gamma, mtp_init=args.mtp_init, progress=False,
                             log=lambda line: None)
    return imported.model.eval(), imported.hf.vocab_size


def make_prompts(args, vocab):
    import torch

    if not args.hf_dir:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab, (int(n),), generator=g).tolist()
                for n in torch.randint(16, 49, (args.prompts,), generator=g)]
    from bebop_megatron.data.tokenizer import tokenizer_from_dir
    from bebop_megatron.speculative.session import prompt_ids

    tok = tokenizer_from_dir(args.hf_dir)  # the model's chat template, as tools/speculative_generate.py renders it
    texts = [CHAT[i % len(CHAT)] + ("" if i < len(CHAT) else f" (variant {i // len(CHAT)})")
             for i in range(args.prompts)]
    out = [prompt_ids(tok, [{"role": "user", "content": text}]) for text in texts]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.vllm_worker:
        vllm_worker(args.vllm_worker)
        return {}
    import tempfile

    import torch

    from bebop_megatron.speculative.batched_spec import BatchedSpecModel, batched_generate
    from bebop_megatron.speculative.decoding import speculative_generate
    from bebop_megatron.speculative.measure import measured
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    model, vocab = real_model(args) if args.hf_dir else tiny_model()
    prompts = make_prompts(args, vocab)
    seeds = list(range(len(prompts)))
    single = MegatronSpecModel(model, vocab)
    batched = BatchedSpecModel(model, vocab, weight_VH=single.weight_VH)
    kw = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, mode="rs")
    last = {}

    def run_single():
        gens = [speculative_generate(single, p, gamma=args.gamma, generator=torch.Generator().manual_seed(s), **kw)
                for p, s in zip(prompts, seeds)]
        last["single"] = gens
        return sum(len(g.new_tokens) for g in gens)

    def run_batched(gamma):
        gens = []
        for lo in range(0, len(prompts), args.batch_size):
            gens += batched_generate(batched, prompts[lo: lo + args.batch_size], seeds[lo: lo + args.batch_size],
                                     gamma=gamma, **kw)
        last["batched" if gamma else "batched_plain"] = gens
        return sum(len(g.new_tokens) for g in gens)

    variants = {"batched": lambda: run_batched(args.gamma), "batched_plain": lambda: run_batched(0)}
    if not args.skip_single:
        variants = {"single": run_single, **variants}
    tmp = Path(tempfile.mkdtemp(prefix="bench_spec_"))
    engines = {}
    if args.vllm:
        engines["vllm_plain"] = VLLM(args, prompts, tmp)
    if args.vllm_spec:
        engines["vllm_spec"] = VLLM(args, prompts, tmp, gamma=args.gamma)
    rates = {name: [] for name in [*variants, *engines]}
    for name, fn in variants.items():  # warm-up (allocator, RoPE tables), not timed
        if name != "single":
            fn()
    try:
        for r in range(args.repeats):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                tokens = fn()
                rates[name].append(tokens / (time.perf_counter() - t0))
            for name, engine in engines.items():
                tokens, seconds = engine.run()
                rates[name].append(tokens / seconds)
            print(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()),
                  file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    metrics = {f"{name}_tokens_per_s": statistics.median(v) for name, v in rates.items()}
    b = metrics["batched_tokens_per_s"]
    if "single" in variants:
        metrics["batched_over_single"] = b / metrics["single_tokens_per_s"]
        agree = [x.tokens == y.tokens for x, y in zip(last["single"], last["batched"])]
        metrics["agree"] = sum(agree) / len(agree)
    if "vllm_plain" in engines:
        metrics["vllm_plain_over_batched_plain"] = (metrics["vllm_plain_tokens_per_s"]
                                                    / metrics["batched_plain_tokens_per_s"])
    if "vllm_spec" in engines:
        metrics["vllm_spec_over_batched"] = metrics["vllm_spec_tokens_per_s"] / b
    metrics["accepted_per_verification"] = measured(last["batched"], args.gamma)["measured_accept_len"]
    metrics["load_avg_1m_before"], metrics["load_avg_1m_after"] = load_before, os.getloadavg()[0]
    params = {"model": Path(args.hf_dir).name if args.hf_dir else "tiny_random", "mtp_init": args.mtp_init
              if args.hf_dir else "random", "prompts": args.prompts, "max_new": args.max_new_tokens,
              "gamma": args.gamma, "T": args.temperature, "batch": args.batch_size, "threads": args.threads,
              "repeats": args.repeats}
    if not args.no_csv:
        append_results("bench_speculative_decode", "cpu", params, metrics, torch.__version__)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    return metrics


if __name__ == "__main__":
    main()
