"""Packing with document boundaries, overlong handling, blends, determinism and resume (data/packing.py)."""

from __future__ import annotations

import itertools
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

from bebop_megatron.config import load_config
from bebop_megatron.data import DataWarning, PackedDataset, batch_iterator, build_train_dataset
from bebop_megatron.data.packing import epoch_counts
from tests.helpers.data import write_jsonl

PAD = -7  # a value no document uses


class FakeSource:
    """Document j of source s: tokens 10000*s + 100*j + (0..n-1); random trained flags."""

    def __init__(self, lengths, s=0, seed=0):
        self.name, self.s = f"fake{s}", s
        self._lengths = np.asarray(lengths, dtype=np.int64)
        rng = np.random.default_rng(seed)
        self.masks = [rng.integers(0, 2, n).astype(np.uint8) for n in self._lengths]
        self.reads = 0

    @property
    def lengths(self):
        return self._lengths

    def get(self, j):
        self.reads += 1
        return 10000 * self.s + 100 * j + np.arange(self._lengths[j]), self.masks[j]


def _packed(sources, S, **kw):
    kw.setdefault("log", lambda s: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        return PackedDataset(sources, S, PAD, **kw)


def _reference_row(ds, i):
    """Position-by-position expectation from the documents the plan put in row ``i``."""
    S = ds.seq_length
    slots = []  # (token, trained, segment, position) of the S+1 stream slots
    for k, (s, d) in enumerate(ds.row_documents(i)):
        tokens, mask = ds.sources[s].get(d)
        for p in range(min(len(tokens), S + 1)):
            slots.append((int(tokens[p]), int(mask[p]), k, p))
    assert len(slots) <= S + 1
    slots += [(PAD, 0, -1, 0)] * (S + 1 - len(slots))
    exp = {k: [] for k in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids")}
    for t in range(S):
        tok, _, seg, pos = slots[t]
        nxt_tok, nxt_trained, nxt_seg, _ = slots[t + 1]
        same = seg >= 0 and nxt_seg == seg
        exp["tokens"].append(tok)
        exp["labels"].append(nxt_tok if same else PAD)
        exp["loss_mask"].append(float(same and nxt_trained))
        exp["position_ids"].append(pos)
        exp["segment_ids"].append(seg)
    return exp


@pytest.mark.parametrize("S", [1, 7, 16, 41])
def test_rows_match_reference_and_keep_boundaries(S):
    rng = np.random.default_rng(S)
    sources = [FakeSource(rng.integers(2, 30, 37), s=0, seed=1), FakeSource(rng.integers(2, 60, 11), s=1, seed=2)]
    ds = _packed(sources, S, seed=5)
    for i in range(len(ds) + 5):  # into the second epoch
        row = ds.row(i)
        exp = _reference_row(ds, i)
        for key, value in exp.items():
            assert row[key].tolist() == value, (i, key)
        seg, lm, pos = row["segment_ids"], row["loss_mask"], row["position_ids"]
        # No trained label crosses a document: the label's token is the next slot of the same segment.
        for t in np.flatnonzero(lm):
            if t + 1 < S:
                assert seg[t + 1] == seg[t] and row["labels"][t] == row["tokens"][t + 1]
            assert row["labels"][t] == row["tokens"][t] + 1  # fake documents count up by one
        # Positions restart exactly where a new document starts.
        for k in range(seg.max() + 1):
            assert pos[seg == k].tolist() == list(range(int((seg == k).sum())))
        assert np.all(np.diff(seg[seg >= 0]) >= 0) and np.all(lm[seg < 0] == 0)
        assert row["tokens"].dtype == np.int64 and lm.dtype == np.float32


def test_each_epoch_uses_every_document_once_and_reshuffles():
    lengths = np.random.default_rng(0).integers(2, 12, 50)
    ds = _packed([FakeSource(lengths)], 16, seed=3)
    e0, e1 = ds.plan(0), ds.plan(1)
    for plan in (e0, e1):
        assert sorted(plan.documents.tolist()) == list(range(50))
        # Next fit: each row's next document would not have fitted in its remaining space.
        fills = [int(lengths[plan.documents[a:b]].sum()) for a, b in zip(plan.row_starts[:-1], plan.row_starts[1:])]
        assert all(f <= 17 for f in fills)
        for r in range(plan.num_rows - 1):
            assert fills[r] + lengths[plan.documents[plan.row_starts[r + 1]]] > 17
    assert e0.documents.tolist() != e1.documents.tolist()
    # Global rows continue into epoch 1.
    assert ds.locate(len(ds)) == (1, 0)
    assert ds.row_documents(len(ds)) == [(0, d) for d in e1.documents[e1.row_starts[0]:e1.row_starts[1]]]


def test_plan_reads_lengths_only():
    src = FakeSource(np.full(1000, 9))
    ds = _packed([src], 32, seed=1)
    ds.locate(5 * len(ds))  # plans six epochs
    assert src.reads == 0
    ds.row(3)
    assert src.reads == len(ds.row_documents(3))


def test_determinism_by_seed():
    lengths = np.random.default_rng(1).integers(2, 20, 40)
    a, b, c = (_packed([FakeSource(lengths)], 24, seed=s) for s in (11, 11, 12))
    rows = lambda ds: [ds.row_documents(i) for i in range(2 * len(ds))]  # noqa: E731
    assert rows(a) == rows(b)
    assert rows(a) != rows(c)
    valid = _packed([FakeSource(lengths)], 24, seed=11, shuffle=False)
    assert [d for i in range(len(valid)) for _, d in valid.row_documents(i)] == list(range(40))


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_truncate_or_drop_counted_in_one_warning(overlong):
    src = FakeSource([5, 30, 7, 50, 16, 17, 1])  # capacity S+1 = 16; 30, 50, 17 are too long; 1 has no label
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = PackedDataset([src], 15, PAD, overlong=overlong, seed=0, log=lambda s: None)
    long_warnings = [w for w in caught if "longer than" in str(w.message)]
    assert len(long_warnings) == 1
    assert "3 of 7 documents are longer than train.seq_length + 1 = 16 tokens (longest 50)" in str(long_warnings[0].message)
    docs = sorted(d for i in range(len(ds)) for _, d in ds.row_documents(i))
    if overlong == "truncate":
        assert ds.num_truncated == 3 and ds.num_dropped == 1 and docs == [0, 1, 2, 3, 4, 5]
        for i in range(len(ds)):
            if (0, 3) in ds.row_documents(i):
                row = ds.row(i)  # alone in its row: 16 tokens = 15 inputs + the last label
                assert row["tokens"].tolist() == list(range(300, 315)) and row["labels"][-1] == 315
    else:
        assert ds.num_truncated == 0 and ds.num_dropped == 4 and docs == [0, 2, 4]


def test_blend_proportions_and_streams():
    big, small = FakeSource(np.full(100, 4), s=0), FakeSource(np.full(50, 4), s=1)
    assert epoch_counts([100, 50], [3.0, 1.0]).tolist() == [113, 37]  # 112.5/37.5: largest remainder, total 150
    assert epoch_counts([100, 50], None).tolist() == [100, 50]
    ds = _packed([big, small], 15, weights=[3.0, 1.0], seed=2)
    counts = Counter(s for i in range(len(ds)) for s, _ in ds.row_documents(i))
    assert counts == {0: 113, 1: 37}
    # The up-weighted source repeats only after a full pass; the small one continues across epochs.
    e0, e1 = ds.plan(0), ds.plan(1)
    big_stream = np.concatenate([e0.documents[e0.sources == 0], e1.documents[e1.sources == 0]])
    assert sorted(big_stream[:100].tolist()) == list(range(100))
    small_stream = np.concatenate([e0.documents[e0.sources == 1], e1.documents[e1.sources == 1]])
    assert sorted(small_stream[:50].tolist()) == list(range(50))
    # Interleaved, not one source after the other.
    first_half = e0.sources[: len(e0.sources) // 2]
    assert 0.15 < first_half.mean() < 0.35


# --------------------------------------------------------------------------- resume


def _cfg(path, S=32):
    return load_config(None, [f"data.train_files=[{path}]", f"train.seq_length={S}", "data.seed=9"])


def _run(cfg, *, steps, start, dp_size, gbs=6, mbs=1):
    """Rows per global step, from a freshly built dataset (as after a restart); each rank's
    micro-batches are checked against ``row(sample_id)``."""
    ds = build_train_dataset(cfg, log=lambda s: None, progress=False)
    per_step = []
    iters = [batch_iterator(ds, start_sample=start, global_batch_size=gbs, micro_batch_size=mbs, dp_rank=r,
                            dp_size=dp_size) for r in range(dp_size)]
    for _ in range(steps):
        rows = []
        for it in iters:
            for mb in next(it):
                for b, sid in enumerate(mb.sample_ids.tolist()):
                    rows.append((sid, mb.tokens[b].tolist(), mb.loss_mask[b].tolist(), mb.segment_ids[b].tolist()))
                    assert torch.equal(mb.labels[b], torch.from_numpy(ds.row(sid)["labels"]))
        per_step.append(rows)
    return ds, per_step


@pytest.mark.parametrize("dp_before, dp_after", [(2, 1), (1, 2), (2, 3)])
def test_resume_with_other_dp_size_sees_the_same_rows(tmp_path, dp_before, dp_after):
    rng = np.random.default_rng(4)  # 4 to 12 byte tokens per document: about 3 per row of 32
    records = [{"prompt": "q" * rng.integers(1, 5), "response": "r" * rng.integers(1, 7)} for _ in range(30)]
    cfg = _cfg(write_jsonl(tmp_path / "d.jsonl", records))
    n_steps, m_steps, gbs = 8, 3, 6
    ds, full = _run(cfg, steps=n_steps, start=0, dp_size=1, gbs=gbs)
    assert n_steps * gbs > 2 * len(ds)  # the run crosses epoch boundaries
    _, first = _run(cfg, steps=m_steps, start=0, dp_size=dp_before, gbs=gbs)
    _, rest = _run(cfg, steps=n_steps - m_steps, start=m_steps * gbs, dp_size=dp_after, gbs=gbs)
    resumed = first + rest
    for g in range(n_steps):
        assert sorted(resumed[g]) == sorted(full[g])
        assert [r[0] for r in full[g]] == list(range(g * gbs, (g + 1) * gbs))
    ids = [r[0] for step in resumed for r in step]
    assert sorted(ids) == list(range(n_steps * gbs))  # no repeats, no skips


def test_iterator_over_packed_rows_builds_batches(tmp_path):
    cfg = _cfg(write_jsonl(tmp_path / "d.jsonl", [{"text": "x" * k} for k in range(1, 40)]), S=16)
    with pytest.warns(DataWarning, match="24 of 39 documents are longer than"):
        ds = build_train_dataset(cfg, log=lambda s: None, progress=False)
    (mb0, mb1), = itertools.islice(batch_iterator(ds, start_sample=4, global_batch_size=4, micro_batch_size=2,
                                                  dp_rank=0, dp_size=1), 1)
    assert mb0.sample_ids.tolist() == [4, 5] and mb1.sample_ids.tolist() == [6, 7]
    for key in ("tokens", "labels", "position_ids", "segment_ids"):
        assert getattr(mb0, key).dtype == torch.int64 and getattr(mb0, key).shape == (2, 16)
    assert mb0.loss_mask.dtype == torch.float32
    assert torch.equal(mb1.tokens[1], torch.from_numpy(ds.row(7)["tokens"]))
