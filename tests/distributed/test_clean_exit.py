"""A run that succeeded exits 0 on every rank (issue 36 item 1).

After a successful quick start, a rank sometimes died in the interpreter's teardown with
"terminate called without an active exception" (SIGABRT, exit status 1 under torchrun; 134 after
an agreed error line): the process groups' native threads outlived the interpreter. The entry
points now destroy the process groups at exit when every rank exits alike
(``bebop_megatron.platform.close_distributed_at_exit``). A tiny 2-rank run with a save, a few
times: exit 0 on both ranks each time, the process group destroyed before the teardown, and
``run.lock`` released.
"""

from __future__ import annotations

from tests.helpers.production import output, run_ranks

TINY = [
    "device=cpu", "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
    "model.num_attention_heads=2", "model.num_query_groups=1", "model.vocab_size=64", "train.seq_length=16",
    "train.micro_batch_size=1", "train.global_batch_size=2", "train.steps=2", "mtp.num_steps=2",
]


def test_a_successful_run_exits_0_on_every_rank_with_its_process_group_destroyed(tmp_path):
    for attempt in range(3):
        ckpt = tmp_path / f"ckpt{attempt}"
        stream = tmp_path / f"run{attempt}.jsonl"
        codes = run_ranks(stream, ["--report-exit", *TINY, f"save.dir={ckpt}"], nproc=2)
        errs = [output(stream, rank)[1] for rank in (0, 1)]
        assert codes == [0, 0], errs
        for err in errs:
            assert err.strip().splitlines()[-1] == "at exit: process group destroyed", err[-2000:]
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest"]  # no run.lock left
    # An agreed error line exits alike: 2 on both ranks, the group destroyed too.
    stream = tmp_path / "refused.jsonl"
    codes = run_ranks(stream, ["--report-exit", *TINY, f"save.dir={tmp_path / 'ckpt0'}", "train.resume=none"],
                      nproc=2)
    errs = [output(stream, rank)[1] for rank in (0, 1)]
    assert codes == [2, 2], errs
    assert all(err.strip().splitlines()[-1] == "at exit: process group destroyed" for err in errs), errs
