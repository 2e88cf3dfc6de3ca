"""Checks on ``convert_to_hf`` results about the step-to-step hand-off (shared by the export tests)."""

from __future__ import annotations


def failed_at_step_2(proc, engine: str, trained: str, num_steps: int = 3) -> None:
    """--verify stopped at draft step 2 with one ``error:`` line naming the step and both
    hand-offs, step 1 having matched; the warning printed before writing names the same
    mismatch. (Loading the model writes library warnings to stderr too.)"""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    line = errors[0]
    assert line.startswith(f"error: verification failed: draft logits of MTP step 2 of {num_steps}:"), line
    assert (f"hands each draft step the next the {engine} state" in line
            and f"trained with mtp.next_step_input={trained} (a hand-off mismatch); step 1 matched" in line), line
    assert f"warning: the MTP heads were trained with mtp.next_step_input={trained}" in proc.stdout, proc.stdout
