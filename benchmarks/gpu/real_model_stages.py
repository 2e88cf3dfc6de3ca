"""The GPU study's first stages (``benchmarks/gpu/real_model_study.py``): the model from the
carried GGUF, then the objective study's own stages (:mod:`bebop_megatron.study.stages`): its
Megatron import, the model's own responses and their indexed datasets. Each resumes from
``--work``: a finished stage is skipped."""

from __future__ import annotations

import time
from pathlib import Path

import models  # benchmarks/real_model/models.py (on the study's path)
from real_model_files import SPEC, STATUS_FILE, StudyError, log

from bebop_megatron.study import stages


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
    return stages.stage_import(hf, work, mtp_num_steps=3)


def stage_responses(hf: Path, prompts: Path, data: Path, args, deadline: float) -> dict:
    """The model's answers at T=1 to the carried prompts (:func:`bebop_megatron.study.stages.stage_responses`);
    generation stops at ``deadline`` (between chunks)."""
    sets = stages.prompt_sets(prompts, args.num_train, args.num_heldout)
    return stages.stage_responses(hf, sets, data, device=args.device, seed=args.seed,
                                  max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size,
                                  chunk_batches=args.gen_chunk_batches, deadline=deadline,
                                  engine=getattr(args, "gen_engine", "hf"), cuda_graphs=getattr(args, "cuda_graphs", False))


stage_tokenize = stages.stage_tokenize
free_cuda = stages.free_cuda
