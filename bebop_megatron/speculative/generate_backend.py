"""Generation backend over the project's own Megatron model and batched sampler
(``tools/generate_responses.py --megatron DIR``; the study's responses stage with
``--responses-backend megatron``).

``DIR`` is an import of ``tools/convert_from_hf.py`` (``bebop_model.yaml``, the weights, and
``hf/`` with the tokenizer and generation config), or a Hugging Face model directory, which
is imported in memory by the same importer. Only the backbone is used (a trained head's
backbone is the frozen import). The prompts, the end-of-turn ids, the seeds and the sampler
are :class:`~bebop_megatron.data.generate_hf.HFBackend`'s, so the records (text,
``prompt_ids``, ``response_ids``, ``finish_reason``) are the same as long as the logits are.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterator, Union

import torch

from bebop_megatron.data.generate import Completion, Failure, Job
from bebop_megatron.data.generate_hf import ChatPrompts, resolve_device_dtype, end_of_turn_ids, load_chat_tokenizer
from bebop_megatron.speculative.batched import BatchedGenerator

IMPORT_RECORD = "bebop_model.yaml"


def load_backbone(path: str, log=None):
    """``(model, vocab_size, tokenizer_dir)``: the Megatron model (CPU, fp32, eval mode) of an
    import directory or of a Hugging Face directory imported in memory."""
    from bebop_megatron.convert.errors import ConvertError

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if not os.path.isdir(path):
        raise ValueError(f"--megatron {path}: not a directory")
    try:
        if os.path.isfile(os.path.join(path, IMPORT_RECORD)):
            return _load_import(path)
        if os.path.isfile(os.path.join(path, "config.json")):
            from bebop_megatron.convert.importer import load_hf_model

            imported = load_hf_model(path, progress=False, log=log)
            return imported.model, imported.hf.vocab_size, path
    except ConvertError as err:
        raise ValueError(f"--megatron {path}: {err}") from None
    raise ValueError(f"--megatron {path}: neither an import of tools/convert_from_hf.py ({IMPORT_RECORD}) nor a "
                     "Hugging Face model directory (config.json)")


def _load_import(path: str):
    from omegaconf import OmegaConf

    from bebop_megatron.convert import megatron_io
    from bebop_megatron.convert.hf_config import describe, read_config
    from bebop_megatron.training.model_weights import is_backbone_key

    sections = OmegaConf.to_container(OmegaConf.load(os.path.join(path, IMPORT_RECORD)))
    hf_dir = os.path.join(path, "hf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(f"--megatron {path}: no hf/config.json (the import's copy of the source config)")
    mtp = sections.get("mtp") or {}
    cfg = megatron_io.make_config(sections["model"], mtp.get("num_layers", 1), mtp.get("num_steps", 1))
    model = megatron_io.build(cfg)
    megatron_io.load(path, model, is_backbone_key)
    return model, describe(read_config(hf_dir)).vocab_size, hf_dir


class MegatronBackend(ChatPrompts):
    """The batched generator over the Megatron model of ``path`` (see the module's docstring)."""

    def __init__(self, path: str, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 batch_size: int = 8, device: str = "auto", dtype: str = "auto", threads: int | None = None,
                 cuda_graphs: bool = False):
        if threads:
            torch.set_num_threads(threads)
        self.device, torch_dtype = resolve_device_dtype(device, dtype)
        if cuda_graphs and self.device != "cuda":
            raise ValueError("--cuda-graphs needs --device cuda")
        model, vocab_size, tokenizer_dir = load_backbone(path)
        if self.device == "cuda":  # the import's CPU mode would rewrite "cuda" to the CPU; at TP=1 the
            from bebop_megatron.platform import cpu_mode  # forward makes no collective call on its gloo group

            cpu_mode.disable()
        self.tokenizer = load_chat_tokenizer(tokenizer_dir, f"--megatron {path}")
        self.eos_ids = end_of_turn_ids(_generation_eos(tokenizer_dir), self.tokenizer, f"--megatron {path}")
        to_device(model, self.device, torch_dtype)
        self.generator = BatchedGenerator(model, vocab_size, eos_ids=self.eos_ids, cuda_graphs=cuda_graphs)
        self.max_new_tokens, self.temperature, self.top_p, self.batch_size = (max_new_tokens, temperature, top_p,
                                                                              batch_size)

    def generate(self, jobs: list[Job]) -> Iterator[tuple[Job, Union[Completion, Failure]]]:
        for failures, ready in self.ready_batches(jobs, self.batch_size):
            yield from failures
            if not ready:
                continue
            out = self.generator.generate([ids for _, ids in ready], [job.seed for job, _ in ready],
                                          max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                          top_p=self.top_p)
            for (job, prompt), new in zip(ready, out.tokens):
                yield job, self.completion(prompt, new)


def to_device(model, device: str, dtype: torch.dtype) -> None:
    """``model`` on ``device`` in ``dtype``, except its RoPE frequencies, which stay float32
    (cast to bf16 they would move every position's angle)."""
    model.to(device=device)
    rope = getattr(model, "rotary_pos_emb", None)
    for module in model.children():
        if module is not rope:
            module.to(dtype=dtype)


def _generation_eos(directory: str):
    """``eos_token_id`` of ``directory/generation_config.json``, else of ``config.json``, as
    transformers' ``generation_config`` gives it to HFBackend."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path) as f:
                found = json.load(f).get("eos_token_id")
            if found is not None:
                return found
    return None
