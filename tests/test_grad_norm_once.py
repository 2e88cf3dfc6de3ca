"""The numerics guard and Megatron's gradient clipping share one gradient-norm pass per step.

``tests/helpers/probe_grad_norm.py`` runs one optimizer step the old way (guard norm, then
Megatron's ``optimizer.step()`` reducing the norm again) and the new way
(``Trainer.optimizer_step``: ``platform/grad_norms.py``) from the same weights, gradients and
fresh Adam state, with a clip threshold that clips. Checked: bit-identical clipped gradients
and weights, both against the float64 formula (clip by the global norm, first Adam step), one
``get_grad_norm_fp32`` call fewer, and a NaN or Inf in one gradient skips the update. With
``mtp.detach_heads=true`` Megatron puts every MTP parameter in a separate grad-norm group,
which its main norm (all the guard used to see) leaves out.
"""

from __future__ import annotations

import json

from tests.helpers.launch import run_script

TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
    "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2", "train.warmup_fraction=0",
    "train.lr=0.01", "train.clip_grad=0.01", "train.adam_eps=1e-4",
]


def test_one_norm_pass_same_clipped_step_and_guard_trips():
    proc = run_script("probe_grad_norm.py", [*TINY, "--", *TINY, "mtp.detach_heads=true"], nproc=1)
    plain, detached = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for case in (plain, detached):
        assert case["clip_coeff"] < 0.5  # the threshold clips
        assert case["max_diff_clipped_grad_after_vs_before"] == 0.0
        assert case["max_diff_after_vs_before"] == 0.0
        assert case["max_rel_diff_clipped_grad_vs_reference"] < 1e-6
        assert case["max_diff_after_vs_reference"] < 1e-6 < case["max_update"]
        assert abs(case["after"]["norm"] - case["reference_norm"]) < 1e-6 * case["reference_norm"]
        assert case["after"]["norm_passes"] == case["before"]["norm_passes"] - 1
        for bad in ("nan", "inf"):
            assert case[bad]["skipped"] and case[bad]["unchanged"], case[bad]
            assert case[bad]["norm"] == bad
    assert plain["before"]["norm_passes"] == 2 and plain["after"]["norm_passes"] == 1
    # detach_heads: the main norm covers no parameter, the 'mtp' group all of them; the guard
    # used to look at the main norm only (0.0: a NaN gradient went through), now at both.
    assert detached["after"]["norm_passes"] == 2
    assert detached["nan"]["megatron_main_norm"] == "0.0"
