"""The frozen backbone builds no graph, and a reused MTP layer gathers every step's gradient."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import run_script

# Big enough that activations dominate, small enough for a 2-core CI machine.
MEMORY_MODEL = ["model.num_layers=8", "train.seq_length=256", "train.micro_batch_size=4", "train.global_batch_size=4"]


def probe(*probes: tuple[str, list[str]]) -> list[dict]:
    """``(what, overrides)`` probes of tests/helpers/probe_step.py, in one process, in order."""
    args = [arg for i, (what, overrides) in enumerate(probes) for arg in [*(["--"] if i else []), what, *overrides]]
    proc = run_script("probe_step.py", args, nproc=1)
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(probes):]]


@pytest.fixture(scope="module")
def probes():
    """Two processes, as ``memory`` measures a process's peak RSS: the frozen model's step, then
    the repeated-layer probes; the trainable model's step."""
    frozen, *repeated = probe(("memory", MEMORY_MODEL), ("repeated", ["mtp.num_layers=1", "mtp.num_steps=3"]),
                              ("repeated", ["mtp.num_layers=1", "mtp.num_steps=1"]),
                              ("repeated", ["mtp.num_layers=3", "mtp.num_steps=3"]))
    (trainable,) = probe(("memory", MEMORY_MODEL + ["model.freeze_backbone=false"]))
    return {"frozen": frozen, "trainable": trainable, "repeated": repeated}


def test_frozen_backbone_stores_no_activations(probes):
    frozen, trainable = probes["frozen"]["saved_activation_bytes"], probes["trainable"]["saved_activation_bytes"]
    # Saved for backward: only the K=3 MTP layer passes and the loss when frozen, against
    # 8 backbone + 3 MTP layer passes when trainable. Counted in layer passes the ratio is
    # 3/11 = 0.27; the loss adds to both.
    assert frozen < 0.4 * trainable, (frozen, trainable)


def test_frozen_backbone_step_uses_less_peak_memory(probes):
    frozen, trainable = probes["frozen"]["rss_growth_kb"], probes["trainable"]["rss_growth_kb"]
    # Peak RSS growth over the first step (activations, gradients, optimizer state).
    assert frozen < 0.75 * trainable, (frozen, trainable)


def test_repeated_mtp_layer_shares_weights_and_gathers_all_steps(probes):
    repeated, single, distinct = probes["repeated"]
    assert repeated["num_mtp_layers"] == 1 and distinct["num_mtp_layers"] == 3
    # One set of weights, whatever K.
    assert repeated["mtp_param_numel"] == single["mtp_param_numel"] == distinct["mtp_param_numel"] // 3
    # The shared layer's gradient is the sum of all K steps' gradients, each non-zero.
    assert repeated["max_rel_diff_full_vs_sum"] < 1e-5
    assert len(repeated["per_step_grad_norms"]) == 3
    assert min(repeated["per_step_grad_norms"]) > 0
