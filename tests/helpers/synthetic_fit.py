"""A tiny fitted synthetic backbone shared by the tests (fitted once per session, ~seconds).

The config mirrors the quick start (``model.backbone_init=fit_synthetic``, a language whose
entropy varies by token) at a tiny size, so the fit and every run on it stay fast.
"""

from __future__ import annotations

TINY_FIT = [
    "model.backbone_init=fit_synthetic", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=64", "train.seq_length=32",
    "data.markov_branching=16", "data.markov_min_branching=2", "data.num_samples=512",
]


def tiny_config(*overrides):
    from bebop_megatron.config import load_config

    return load_config(None, ["device=cpu", *TINY_FIT, *overrides])
