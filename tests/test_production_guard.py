"""Numerics guard: a non-finite loss skips the update (counted, logged); too many in a row abort.

One CPU rank, NaN injected into the loss of steps 2, 4 and 5 with ``train.max_skipped_steps=2``:
step 2 is skipped (weights unchanged), step 3 trains again and resets the count, steps 4 and 5
are two in a row, so the run stops at step 5 with the one-line error and exit status 3.
"""

from __future__ import annotations

import math

from tests.helpers.production import output, read_stream, run_ranks

TINY = [
    "device=cpu", "parallel.tensor=1", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.seq_length=32", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.vocab_size=200", "save.dir=null",
]


def test_nonfinite_steps_are_skipped_and_consecutive_ones_abort(tmp_path):
    stream = tmp_path / "steps.jsonl"
    codes = run_ranks(stream, ["--nan-steps", "2,4,5", *TINY, "train.steps=8", "train.max_skipped_steps=2"], nproc=1)
    stdout, stderr = output(stream, 0)
    assert codes == [3], stderr[-3000:]
    rows = read_stream(stream)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # step 5 raised before it was recorded
    assert [r["skipped"] for r in rows] == [False, True, False, True]
    assert math.isnan(rows[1]["loss"]) and math.isfinite(rows[2]["loss"])
    checksums = [r["checksum"] for r in rows]
    assert checksums[1] == checksums[0]  # the skipped step left the MTP weights untouched
    assert checksums[2] != checksums[1] and math.isfinite(checksums[2])  # and training went on
    assert checksums[3] == checksums[2]
    assert "step 2: non-finite loss or gradient, update skipped (1 in a row, 1 in all)" in stdout
    assert "step 4: non-finite loss or gradient, update skipped (1 in a row, 2 in all)" in stdout
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: step 5: 2 consecutive steps with a non-finite loss or gradient (train.max_skipped_steps=2, "
        "3 skipped in all); the run diverged: lower train.lr, use precision=fp32, or check the data; "
        "train.resume=auto restarts from the latest checkpoint"
    ], stderr[-3000:]
    assert "Traceback" not in stderr
