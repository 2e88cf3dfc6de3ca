"""On-policy held-out text for the decode-exact forecast (``tools/eval_acceptance.py --sample``).

The decode-exact E[L] (:mod:`bebop_megatron.chain.decode_exact`) is exact on text sampled
from the target at the temperature of interest. Held-out data rarely is (other models' answers,
another temperature), so ``--sample`` first samples, at each temperature, a continuation of
every held-out prompt from the checkpoint's own backbone (plain decoding, one token per
forward, over the KV cache of :class:`~bebop_megatron.speculative.megatron_model.MegatronSpecModel`),
and evaluates those texts instead. A prompt is a document's tokens up to its first trained
label, as the training data renders it (the chat template's generation prompt included); on
the synthetic language it is the first token of a sample.

Legend: S the run's sequence length (a row holds S inputs and S labels: S + 1 tokens).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.distributed as dist

from bebop_megatron.speculative.decoding import autoregressive_generate


def held_out_prompts(dataset, num_rows: int) -> list[list[int]]:
    """The prompt of every document of rows ``0 .. num_rows-1`` that has a trained label: its
    tokens up to and including the position of its first trained label, in row order."""
    prompts = []
    for i in range(num_rows):
        row = dataset.row(i)
        tokens, mask, seg = row["tokens"], row["loss_mask"] > 0, row["segment_ids"]
        for d in np.unique(seg[seg >= 0]):
            where = np.flatnonzero(seg == d)
            trained = where[mask[where]]
            if len(trained):
                prompts.append(tokens[where[0]: trained[0] + 1].tolist())
    return prompts


def sample_texts(spec_model, prompts: list[list[int]], *, temperature: float, max_new_tokens: int | None,
                 seq_length: int, seed: int, stop_ids=(), indices=None, progress=None) -> list[tuple[int, list[int]]]:
    """``(prompt length, prompt + sampled tokens)`` for ``prompts[i]``, i in ``indices`` (default:
    all). Each continuation stops at a stop token, after ``max_new_tokens`` or where the row is
    full (S + 1 tokens); prompt i's draws come from its own seed, so a DP split gives the same texts."""
    out = []
    indices = range(len(prompts)) if indices is None else indices
    for n, i in enumerate(indices):
        prompt = prompts[i][: seq_length]  # at least one label position is left
        room = seq_length + 1 - len(prompt)
        limit = room if max_new_tokens is None else min(max_new_tokens, room)
        gen = autoregressive_generate(spec_model, prompt, temperature=temperature, max_new_tokens=limit,
                                      generator=torch.Generator().manual_seed(seed * 1_000_003 + i),
                                      stop_ids=set(stop_ids))
        out.append((len(prompt), gen.tokens[: seq_length + 1]))
        if progress:
            progress(n + 1, len(indices))
    return out


def sample_rows(spec_model, prompts: list[list[int]], *, temperature: float, max_new_tokens: int | None,
                seq_length: int, seed: int, stop_ids=(), rank: int = 0, world: int = 1) -> "SampledRows":
    """:func:`sample_texts` of every prompt as rows to evaluate; with ``world`` > 1 rank r samples
    prompts r, r + world, ... and the texts are gathered (every rank returns them all, in order)."""
    texts = sample_texts(spec_model, prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                         seq_length=seq_length, seed=seed, stop_ids=stop_ids, indices=range(rank, len(prompts), world))
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, texts)
        texts = [parts[i % world][i // world] for i in range(len(prompts))]
    return SampledRows(texts, seq_length)


def recorded_temperature(paths: list[str]) -> tuple[float | None, str]:
    """The temperature every data file's responses were sampled at, from its ``<file>.settings.json``
    (``tools/generate_responses.py``; full vocabulary, top-p 1, only), and a line saying where it
    comes from; ``(None, why not)`` when a file has no such record or they differ."""
    from bebop_megatron.data.generate import settings_path

    temps = set()
    for path in paths:
        settings = settings_path(path)
        try:
            with open(settings, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None, f"{path} has no readable {os.path.basename(settings)} (pass --data-temperature or --sample)"
        record = record if isinstance(record, dict) else {}
        temp, top_p = record.get("temperature"), record.get("top_p", 1.0)
        if not isinstance(temp, (int, float)) or not temp > 0 or top_p not in (None, 1, 1.0):
            return None, f"{settings}: not sampled at a temperature > 0 with top-p 1 (pass --sample)"
        temps.add(float(temp))
    if len(temps) != 1:
        return None, f"the --data files were sampled at several temperatures {sorted(temps)} (pass --sample)"
    T = temps.pop()
    return T, f"the --data files' .settings.json: sampled at T={T:g} (assumed from this checkpoint's backbone)"


class SampledRows:
    """The sampled texts as one-document rows (:class:`~bebop_megatron.data.batches.RowDataset`):
    the labels of the sampled tokens are trained, the prompt's are not; padding is document -1."""

    def __init__(self, texts: list[tuple[int, list[int]]], seq_length: int):
        self.texts, self.seq_length = texts, seq_length

    def __len__(self) -> int:
        return len(self.texts)

    def row(self, index: int) -> dict[str, np.ndarray]:
        prompt_len, seq = self.texts[index]
        S, L = self.seq_length, len(seq)
        full = np.zeros(S + 1, dtype=np.int64)
        full[:L] = seq
        loss_mask = np.zeros(S, dtype=np.float32)
        loss_mask[prompt_len - 1: L - 1] = 1.0  # labels of the sampled tokens
        segment_ids = np.full(S, -1, dtype=np.int64)
        segment_ids[: min(L, S)] = 0  # every real token is an input (the last one's label is padding)
        return {"tokens": full[:-1], "labels": full[1:], "loss_mask": loss_mask,
                "position_ids": np.arange(S, dtype=np.int64), "segment_ids": segment_ids}


__all__ = ["SampledRows", "held_out_prompts", "recorded_temperature", "sample_rows", "sample_texts"]
