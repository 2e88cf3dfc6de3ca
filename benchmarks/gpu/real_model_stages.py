"""The GPU study's first stages (``benchmarks/gpu/real_model_study.py``): the model from the
carried GGUF, its Megatron import, the model's own responses and their indexed datasets. Each
resumes from ``--work``: a finished stage is skipped."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import models  # benchmarks/real_model/models.py (on the study's path)
from real_model_files import SPEC, STATUS_FILE, StudyError, log

REPO = Path(__file__).resolve().parents[2]


def stage_dequantize(work: Path) -> Path:
    hf = work / "hf"
    if (hf / STATUS_FILE).is_file():
        return hf
    gguf = work / "model.gguf"
    if not gguf.is_file():
        raise StudyError(f"{gguf} is missing: run 'receive --part 1' and 'receive --part 2' first")
    t0 = time.time()
    models.dequantize(gguf, hf, SPEC.hf_class, log=log)
    (hf / STATUS_FILE).write_text("ok\n")
    log(f"dequantize: {time.time() - t0:.0f} s")
    return hf


def stage_import(hf: Path, work: Path) -> Path:
    meg = work / "megatron"
    if (meg / STATUS_FILE).is_file():
        return meg
    shutil.rmtree(meg, ignore_errors=True)
    t0 = time.time()
    subprocess.run([sys.executable, REPO / "tools" / "convert_from_hf.py", "--hf-dir", hf, "--out", meg,
                    "--mtp-num-steps", "3", "--no-progress"], check=True, cwd=REPO)
    (meg / STATUS_FILE).write_text("ok\n")
    log(f"import: {time.time() - t0:.0f} s")
    return meg


def stage_responses(hf: Path, prompts: Path, data: Path, args, deadline: float) -> dict:
    """The model's answers at T=1; generation stops at ``deadline`` (between batches)."""
    from bebop_megatron.data.generate import ExistingOutput, load_existing, plan_jobs, read_prompts, run_generation
    from bebop_megatron.data.generate_hf import HFBackend

    data.mkdir(parents=True, exist_ok=True)
    backend = None
    stats = {}
    for split, limit in (("heldout", args.num_heldout), ("train", args.num_train)):
        out = data / f"{split}.jsonl"
        existing = load_existing(str(out)) if out.is_file() else None
        done = existing.done if existing else set()
        prompt_set = read_prompts(str(prompts / f"{split}.jsonl"), limit=limit)
        jobs = plan_jobs(prompt_set.prompts, 1, args.seed + (split == "heldout"), done)
        written, tokens, seconds = len(done), 0, 0.0
        chunk = args.gen_batch_size * args.gen_chunk_batches
        for lo in range(0, len(jobs), chunk):
            if time.time() > deadline and written > 0:
                log(f"responses ({split}): generation budget spent; {len(jobs) - lo} prompts left out")
                break
            if backend is None:
                backend = HFBackend(str(hf), max_new_tokens=args.max_new_tokens, temperature=1.0,
                                    batch_size=args.gen_batch_size, device=args.device,
                                    dtype="bf16" if args.device == "cuda" else "fp32")
            # Shortest prompts together: less left padding. Sorting within a chunk selects
            # nothing (a chunk is generated whole, the budget is checked between chunks).
            part = sorted(jobs[lo:lo + chunk], key=lambda job: _prompt_length(backend, job))
            summary = run_generation(backend, part, str(out), ExistingOutput(set(), {}), progress=False)
            written += summary.num_written
            tokens += summary.num_tokens
            seconds += summary.seconds
            log(f"responses ({split}): {written} written, {tokens / max(seconds, 1e-9):,.0f} generated tokens/s")
        stats[split] = {"responses": written, "generated_tokens": tokens, "seconds": seconds}
    backend = None  # frees the model before training
    free_cuda()
    return stats


def stage_tokenize(meg: Path, data: Path) -> None:
    """Both response files as indexed datasets (``tools/preprocess_data.py``'s ``preprocess``, with
    the import's tokenizer), once: every trainer then reads them instead of tokenizing the JSONL."""
    from bebop_megatron.data.preprocess import preprocess

    for split in ("train", "heldout"):
        src, stamp = data / f"{split}.jsonl", data / f".{split}.tokenized"
        key = f"{src.stat().st_size}\n"
        if stamp.is_file() and stamp.read_text() == key:
            continue
        t0 = time.time()
        preprocess([str(src)], str(data / split), tokenizer_dir=str(meg / "hf"), train_on="response",
                   on_error="fail", progress=False, overwrite=True)  # the responses changed: tokenized again
        stamp.write_text(key)
        log(f"tokenize ({split}): {time.time() - t0:.1f} s")


def _prompt_length(backend, job) -> int:
    try:
        return len(backend.prompt_ids(job))
    except Exception:  # a template that rejects it: the backend reports it when it generates
        return 0


def free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
