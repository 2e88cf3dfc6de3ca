"""The logged LR is the LR each update used, and warmup never trains a step at LR 0 (issue 26, item 3).

``tests/helpers/probe_lr.py`` trains 4 steps (warmup_fraction=0.5: W=2 warmup steps, then cosine
to min_lr) and records, at each call of torch's Adam, the LR in its param groups and the largest
weight change. Checked: console, metrics file and history report those LRs; they follow the
schedule (step n <= W at lr*n/W, then cosine reaching min_lr at the last step); and step 1's
weights moved by that LR (Adam's first update is lr * g / (|g| + eps), so its largest change is
the LR itself): the first step is not a wasted step at LR 0.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.launch import run_script

LR, MIN_LR, STEPS, WARMUP = 1e-2, 1e-3, 4, 2
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2", f"train.steps={STEPS}",
    "train.warmup_fraction=0.5", "train.lr_schedule=cosine", f"train.lr={LR}", f"train.min_lr={MIN_LR}",
    "train.adam_eps=1e-12", "train.clip_grad=0",
]


def expected_lr(step: int) -> float:
    if step <= WARMUP:
        return LR * step / WARMUP
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def test_logged_lr_is_the_lr_each_update_used(tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"
    proc = run_script("probe_lr.py", ["--metrics-file", str(metrics_file), *TINY], nproc=1)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    used = [u["lr"] for u in result["updates"]]
    assert all(len(lrs) == 1 for lrs in used), used
    used = [lrs[0] for lrs in used]
    assert used == pytest.approx([expected_lr(n) for n in range(1, STEPS + 1)], rel=1e-9)
    assert used[0] == pytest.approx(LR / WARMUP)  # the warmup starts at lr / W, not 0
    assert result["logged"] == used
    assert result["console"] == [f"{lr:.2e}" for lr in used]
    in_file = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [r["train/lr"] for r in in_file if "train/lr" in r] == used
    # independent of the optimizer's bookkeeping: step 1 moved the weights by its LR
    assert result["updates"][0]["max_change"] == pytest.approx(used[0], rel=1e-3)
