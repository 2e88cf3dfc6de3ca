"""The MTP cross-entropy loss (training/loss.py) against plain float64 references.

Definition (loss.py docstring): step k (1..K) at position t predicts labels[t+k]; it is
valid when t+k < S and loss_mask[t+k] is set, and a chain stops at its first invalid
step. Per position with K_t >= 1 valid steps, L_t = (1/K) sum_{k<=K_t} CE_k(t); the
function returns sum_t L_t and the number of such positions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bebop_megatron.chain.masks import chain_valid
from bebop_megatron.data import Batch
from bebop_megatron.losses.objectives import DISTRIBUTION_NAMES
from bebop_megatron.training.loss import DECODE_ROWS, STAT_ROWS, mtp_ce_loss
from tests.helpers.single_process import single_process


def brute_force_chain(loss_mask, K, segment_ids=None):
    """Python-loop reference: bool [K, B, S]."""
    B, S = loss_mask.shape
    out = torch.zeros(K, B, S, dtype=torch.bool)
    for b in range(B):
        for t in range(S):
            for k in range(1, K + 1):
                same_doc = segment_ids is None or (t + k < S and segment_ids[b, t + k] == segment_ids[b, t])
                if t + k < S and loss_mask[b, t + k] > 0 and same_doc:
                    out[k - 1, b, t] = True
                else:
                    break  # the chain stops at its first invalid step
    return out


def _random_mask(B, S, seed, p_hole=0.25):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, S, generator=g) > p_hole).float()
    mask[0, S // 2] = 0.0  # always at least one hole in the middle
    mask[0, S // 2 + 1:] = 1.0  # followed by a fully valid tail
    return mask


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("B, S, K", [(3, 17, 4), (2, 5, 4), (1, 3, 5), (4, 9, 1)])
def test_chain_valid_matches_brute_force(seed, B, S, K):
    mask = _random_mask(B, S, seed)
    got = chain_valid(mask, K)
    assert got.dtype == torch.bool and got.shape == (K, B, S)
    assert torch.equal(got, brute_force_chain(mask, K))


@pytest.mark.parametrize("seed", range(4))
def test_chain_valid_stops_at_document_boundaries(seed):
    g = torch.Generator().manual_seed(seed)
    B, S, K = 3, 23, 4
    mask = _random_mask(B, S, seed, p_hole=0.1)
    # Packed rows: documents of random lengths, then padding (-1).
    segment_ids = torch.full((B, S), -1)
    for b in range(B):
        t, doc = 0, 0
        while t < S - 3:
            n = int(torch.randint(1, 7, (1,), generator=g))
            segment_ids[b, t : t + n] = doc
            t, doc = t + n, doc + 1
    got = chain_valid(mask, K, segment_ids)
    assert torch.equal(got, brute_force_chain(mask, K, segment_ids))
    # No valid step reaches into another document.
    k_idx, b_idx, t_idx = got.nonzero(as_tuple=True)
    assert torch.equal(segment_ids[b_idx, t_idx + k_idx + 1], segment_ids[b_idx, t_idx])


def test_chain_valid_hand_example():
    # S=8, hole at label position 3. Step k at t uses labels[t+k]; chain breaks at the hole.
    mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.float32)
    got = chain_valid(mask, 3)[:, 0].int().tolist()
    assert got == [
        # t: 0  1  2  3  4  5  6  7
        [1, 1, 0, 1, 1, 1, 1, 0],  # k=1: labels[t+1]
        [1, 0, 0, 1, 1, 1, 0, 0],  # k=2: t=1 breaks (labels[3] masked) even though labels[4] is set
        [0, 0, 0, 1, 1, 0, 0, 0],  # k=3: t=0 breaks at labels[3]
    ]


def test_chain_valid_accepts_non_binary_masks():
    # Weights > 0 count as set, 0 as unset (the loss only uses the mask as a boolean).
    mask = torch.tensor([[0.5, 0.0, 2.0, 1.0, 0.0]])
    assert torch.equal(chain_valid(mask, 2), brute_force_chain(mask, 2))


# ---------------------------------------------------------------------------------------
# mtp_ce_loss: needs Megatron's parallel state (1 process, gloo, CPU mode).


@pytest.fixture(scope="module")
def megatron_single_process():
    from megatron.core import parallel_state

    from bebop_megatron.platform import cpu_mode, init_distributed

    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    assert not cpu_mode.is_enabled(), "CPU mode leaked from an earlier test"
    # A single process whatever the environment; restore the variables init_distributed sets.
    with single_process():
        assert init_distributed("cpu") == (0, 1)
        parallel_state.initialize_model_parallel()
        yield parallel_state.get_tensor_model_parallel_group()
    assert not dist.is_initialized() and not cpu_mode.is_enabled()


class StandInModel:
    """What mtp_loss needs from MTPGPTModel: a config, an output layer and its (untied) weight."""

    def __init__(self, weight_VH: torch.Tensor):
        self.weight_VH = weight_VH
        self.calls = 0
        self.config = SimpleNamespace(sequence_parallel=False)
        self.output_layer = _OutputLayer(self)

    def output_weight(self):
        return None


class _OutputLayer:
    def __init__(self, owner: StandInModel):
        self.owner = owner
        self.weight = owner.weight_VH

    def __call__(self, hidden, weight=None):
        self.owner.calls += 1
        w = self.weight if weight is None else weight
        return hidden @ w.t(), None


def _make_case(B, S, H, V, K, seed, mask=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((1 + K) * S, B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5 * 3
    labels = torch.randint(0, V, (B, S), generator=g)
    if mask is None:
        mask = _random_mask(B, S, seed)
    batch = Batch(
        tokens=torch.randint(0, V, (B, S), generator=g),
        labels=labels,
        loss_mask=mask,
        position_ids=torch.arange(S).expand(B, S),
        sample_ids=torch.arange(B),
        segment_ids=torch.zeros(B, S, dtype=torch.long),
    )
    return hidden, weight, batch


def reference_loss(hidden_64, weight_64, labels, loss_mask, K):
    """Float64 plain-torch reference: (loss_sum, count, stats[3, K])."""
    S_all, B, H = hidden_64.shape
    S = S_all // (1 + K)
    valid = brute_force_chain(loss_mask, K)  # [K, B, S]
    loss_sum = hidden_64.new_zeros(())
    stats = torch.zeros(3, K, dtype=torch.float64)
    for k in range(1, K + 1):
        h_SBH = hidden_64[k * S:(k + 1) * S]
        logits_BSV = (h_SBH @ weight_64.t()).transpose(0, 1)
        logp_BSV = torch.log_softmax(logits_BSV, dim=-1)
        for b in range(B):
            for t in range(S):
                if not valid[k - 1, b, t]:
                    continue
                target = labels[b, t + k]
                ce = -logp_BSV[b, t, target]
                loss_sum = loss_sum + ce / K
                stats[0, k - 1] += ce.item()
                stats[1, k - 1] += float(logits_BSV[b, t, target] >= logits_BSV[b, t].max())
                stats[2, k - 1] += 1
    count = int(valid[0].sum())
    return loss_sum, count, stats


CASES = [
    pytest.param(3, 17, 16, 29, 4, 0, id="B3-S17-K4"),
    pytest.param(2, 11, 8, 13, 3, 1, id="B2-S11-K3"),
    pytest.param(1, 6, 8, 7, 5, 2, id="K-near-S"),
    pytest.param(2, 9, 12, 31, 1, 3, id="K1"),
]


@pytest.mark.parametrize("B, S, H, V, K, seed", CASES)
def test_mtp_ce_loss_matches_reference(megatron_single_process, B, S, H, V, K, seed):
    hidden_64, weight_64, batch = _make_case(B, S, H, V, K, seed)
    model = StandInModel(weight_64.float())
    hidden = hidden_64.float().requires_grad_(True)

    loss_sum, count, stats = mtp_ce_loss(model, hidden, batch, K, megatron_single_process)
    # The CE and the acceptance statistics both go through the fused (chunked) projection with
    # the output weight: the output layer is never called, so no full logits tensor exists.
    assert model.calls == 0

    ref_hidden = hidden_64.clone().requires_grad_(True)
    ref_sum, ref_count, ref_stats = reference_loss(ref_hidden, weight_64, batch.labels, batch.loss_mask, K)

    assert ref_count > 0
    assert int(count) == ref_count
    assert stats.shape == (len(STAT_ROWS), K)
    torch.testing.assert_close(loss_sum.double(), ref_sum.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((loss_sum / count).double(), ref_sum.detach() / ref_count, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[0].double(), ref_stats[0], rtol=1e-5, atol=1e-4)  # ce_sum
    assert torch.equal(stats[1].double(), ref_stats[1])  # top1_correct
    assert torch.equal(stats[2].double(), ref_stats[2])  # count
    # Per-step counts are the chain counts, non-increasing in k.
    assert stats[2, 0].item() == ref_count
    assert all(stats[2, k] >= stats[2, k + 1] for k in range(K - 1))
    # loss_sum = (1/K) * sum_k ce_sum_k
    torch.testing.assert_close(loss_sum, stats[0].sum() / K, rtol=1e-6, atol=1e-6)

    # Gradient w.r.t. the hidden states, through the frozen output layer.
    (loss_sum / count).backward()
    (ref_sum / ref_count).backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.float32
    torch.testing.assert_close(hidden.grad.double(), ref_hidden.grad, rtol=1e-4, atol=1e-6)
    # The backbone chunk gets no gradient, nor do positions whose chain is empty.
    assert torch.count_nonzero(hidden.grad[:S]) == 0
    valid = brute_force_chain(batch.loss_mask, K)
    for k in range(1, K + 1):
        invalid_SB = ~valid[k - 1].t()
        assert torch.count_nonzero(hidden.grad[k * S:(k + 1) * S][invalid_SB]) == 0


def test_mtp_ce_loss_top1_counts_argmax_hits(megatron_single_process):
    # Hidden states (= logits) whose argmax is the true target at every other position and
    # another token elsewhere: top1_correct must count exactly those (within the chain).
    B, S, K = 2, 10, 3
    V = H = 12
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S)
    hidden = torch.randn((1 + K) * S, B, H, generator=g) * 0.1
    expected = torch.zeros(K)
    for k in range(1, K + 1):
        for t in range(S - k):
            for b in range(B):
                target = int(labels[b, t + k])
                if (t + b) % 2 == 0:
                    hidden[k * S + t, b, target] += 10.0
                    expected[k - 1] += 1
                else:
                    hidden[k * S + t, b, (target + 1) % V] += 10.0
    batch = Batch(tokens=labels.clone(), labels=labels, loss_mask=mask,
                  position_ids=torch.arange(S).expand(B, S), sample_ids=torch.arange(B),
                  segment_ids=torch.zeros(B, S, dtype=torch.long))
    model = StandInModel(torch.eye(V))  # logits == hidden
    _, count, stats = mtp_ce_loss(model, hidden, batch, K, megatron_single_process)
    assert int(count) == B * (S - 1)
    assert torch.equal(stats[2], torch.tensor([B * (S - k) for k in range(1, K + 1)], dtype=torch.float32))
    assert torch.equal(stats[1], expected)


def test_mtp_ce_loss_top1_is_strict_on_near_ties(megatron_single_process):
    # The target's logit is below the maximum by less than float32 can resolve after
    # exp(): the target does not hold the maximum logit, so top-1 must not count it.
    B, S, K = 1, 4, 1
    V = H = 4
    labels = torch.tensor([[1, 2, 3, 0]])
    hidden = torch.full((2 * S, B, H), -5.0)
    top, below = 1e-3, 1e-3 - 5e-10  # distinct float32 values
    assert torch.tensor(below, dtype=torch.float32) < torch.tensor(top, dtype=torch.float32)
    for t in range(S - 1):
        target = int(labels[0, t + 1])
        hidden[S + t, 0, target] = below
        hidden[S + t, 0, (target + 1) % V] = top
    batch = Batch(tokens=labels.clone(), labels=labels, loss_mask=torch.ones(B, S),
                  position_ids=torch.arange(S).expand(B, S), sample_ids=torch.arange(B),
                  segment_ids=torch.zeros(B, S, dtype=torch.long))
    model = StandInModel(torch.eye(V))
    logits = model.output_layer(hidden[S:], None)[0]
    ref_top1 = sum(
        float(logits[t, 0, labels[0, t + 1]] >= logits[t, 0].max()) for t in range(S - 1)
    )
    assert ref_top1 == 0.0
    _, _, stats = mtp_ce_loss(model, hidden, batch, K, megatron_single_process)
    assert stats[2, 0].item() == S - 1
    assert stats[1, 0].item() == ref_top1


def test_mtp_ce_loss_all_chains_empty(megatron_single_process):
    B, S, H, V, K = 2, 6, 8, 11, 2
    hidden_64, weight_64, batch = _make_case(B, S, H, V, K, seed=9, mask=torch.zeros(2, 6))
    hidden = hidden_64.float().requires_grad_(True)
    loss_sum, count, stats = mtp_ce_loss(StandInModel(weight_64.float()), hidden, batch, K,
                                         megatron_single_process)
    assert int(count) == 0
    assert loss_sum.item() == 0.0
    assert torch.equal(stats, torch.zeros(len(STAT_ROWS), K))
    loss_sum.backward()
    assert torch.count_nonzero(hidden.grad) == 0


@pytest.mark.parametrize("loss_type", DISTRIBUTION_NAMES)
def test_mtp_loss_targets_are_the_backbone_shifted_by_k(megatron_single_process, loss_type):
    """Step k at position t is trained toward the backbone's distribution at t + k."""
    from bebop_megatron.config import LossConfig
    from bebop_megatron.losses import reference
    from bebop_megatron.training.loss import mtp_loss

    B, S, H, V, K = 2, 13, 8, 23, 3
    hidden_64, weight_64, batch = _make_case(B, S, H, V, K, seed=11)
    hidden = hidden_64.float().requires_grad_(True)
    cfg = LossConfig(type=loss_type, target_temperature=0.8, draft_temperature=1.2, chunk_tokens=5, lk_eta=2.0)
    loss_sum, count, stats = mtp_loss(StandInModel(weight_64.float()), hidden, batch, K, megatron_single_process, cfg)

    # Reference: explicit loops over (k, t), float64.
    logits_KSBV = torch.stack([(hidden_64[k * S:(k + 1) * S] @ weight_64.t()) for k in range(K + 1)])
    draft = torch.zeros(K, S, B, V, dtype=torch.float64)
    target = torch.zeros(K, S, B, V, dtype=torch.float64)
    valid = brute_force_chain(batch.loss_mask, K).transpose(1, 2)  # [K, S, B]
    for k in range(1, K + 1):
        draft[k - 1] = logits_KSBV[k]
        for t in range(S - k):
            target[k - 1, t] = logits_KSBV[0, t + k]
    args = (draft.flatten(1, 2), target.flatten(1, 2), valid.flatten(1))
    ref_sum = reference.objective(loss_type, *args, 0.8, 1.2, reduction="sum", lk_eta=2.0)
    ref_stats = reference.stats(*args, 0.8, 1.2)
    assert int(count) == int(valid[0].sum())
    torch.testing.assert_close(loss_sum.double(), ref_sum, rtol=1e-5, atol=1e-6)
    for row, key in enumerate(STAT_ROWS[3:], start=3):
        if key in DECODE_ROWS:  # the held-out pass's only
            assert not stats[row].any()
            continue
        torch.testing.assert_close(stats[row].double(), ref_stats[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("loss_type", ["e2e_tv", "ce"])
def test_mtp_loss_decode_exact_rows(megatron_single_process, loss_type):
    """``decode_exact=True``: the decode-exact sums equal the recursion run on a float64
    reference of min(1, q(x)/p(x)) and 1[x = argmax q] at the data tokens (temperatures
    0.8 / 1.2, chunks of 5 rows)."""
    from bebop_megatron.config import LossConfig
    from bebop_megatron.chain.decode_exact import decode_exact_rows, run_starts
    from bebop_megatron.training.loss import mtp_loss

    B, S, H, V, K = 2, 13, 8, 23, 3
    hidden_64, weight_64, batch = _make_case(B, S, H, V, K, seed=5)
    cfg = LossConfig(type=loss_type, target_temperature=0.8, draft_temperature=1.2, chunk_tokens=5)
    with torch.no_grad():
        _, _, stats = mtp_loss(StandInModel(weight_64.float()), hidden_64.float(), batch, K, megatron_single_process,
                               cfg, decode_exact=True)
    logits = torch.stack([(hidden_64[k * S:(k + 1) * S] @ weight_64.t()) for k in range(K + 1)])  # [1+K, S, B, V]
    given = torch.zeros(2, K, B, S, dtype=torch.float64)
    for k in range(1, K + 1):
        for t in range(S - k):
            x = batch.labels[:, t + k]  # step k at t proposes labels[t+k]
            p = torch.softmax(logits[0, t + k] / 0.8, -1)
            q = torch.softmax(logits[k, t] / 1.2, -1)
            px, qx = p.gather(-1, x[:, None])[:, 0], q.gather(-1, x[:, None])[:, 0]
            given[0, k - 1, :, t] = torch.minimum(px, qx) / px
            given[1, k - 1, :, t] = (q.argmax(-1) == x).double()
    chain = brute_force_chain(batch.loss_mask, K)  # [K, B, S]
    starts = run_starts(batch.loss_mask, batch.segment_ids)
    assert chain[0].any()
    for m, mode in enumerate(("rs", "to")):
        for g in range(1, K + 1):
            acc, ver = decode_exact_rows(given[m], chain, starts, g)
            got_acc = stats[STAT_ROWS.index(f"decode_accepted_{mode}"), g - 1].item()
            got_ver = stats[STAT_ROWS.index(f"decode_verifications_{mode}"), g - 1].item()
            assert got_acc == pytest.approx(acc.sum(), rel=1e-5, abs=1e-6), (mode, g)
            assert got_ver == pytest.approx(ver.sum(), rel=1e-5, abs=1e-6), (mode, g)


def test_mtp_ce_loss_excludes_padded_vocabulary(megatron_single_process):
    """Megatron's zero output rows past ``vocab_size`` (logit 0) are out of the CE's softmax
    and of the statistics: equal to the reference on the unpadded vocabulary."""
    B, S, H, V, K = 2, 11, 8, 13, 3
    hidden_64, weight_64, batch = _make_case(B, S, H, V, K, seed=7)
    padded = torch.cat([weight_64, weight_64.new_zeros(19, H)])  # 13 real tokens in 32 rows
    hidden = hidden_64.float().requires_grad_(True)
    loss_sum, count, stats = mtp_ce_loss(StandInModel(padded.float()), hidden, batch, K, megatron_single_process,
                                         vocab_size=V)
    _, _, unpadded_stats = mtp_ce_loss(StandInModel(weight_64.float()), hidden.detach(), batch, K,
                                       megatron_single_process)
    ref_hidden = hidden_64.clone().requires_grad_(True)
    ref_sum, ref_count, ref_stats = reference_loss(ref_hidden, weight_64, batch.labels, batch.loss_mask, K)
    assert int(count) == ref_count
    torch.testing.assert_close(loss_sum.double(), ref_sum.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[0].double(), ref_stats[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(stats, unpadded_stats, rtol=1e-5, atol=1e-5)  # alpha, H(p), ... as unpadded
    (loss_sum / count).backward()
    (ref_sum / ref_count).backward()
    torch.testing.assert_close(hidden.grad.double(), ref_hidden.grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Context parallelism (parallel.context = C > 1): every loss.type on the CP ranks' shards
# against the whole row, in one process. Each rank's share of the model's hidden states is its
# two chunks (cp_attention.shard_sequence) of the backbone and of every MTP step; the layout's
# all-gather of the chunks' first K backbone rows is served from the ranks' shards. The ranks'
# loss sums, counts and statistics add up to those of the whole row (the trainer sums them over
# the CP group), and their gradients, put back in row order, are the whole row's.


class _FakeCPGroup:
    """The CP group of ``C`` ranks as ``_ContextParallelLayout`` reads it; ``rank`` is the rank
    whose loss runs now, ``heads[c]`` what rank c contributes to the all-gather."""

    def __init__(self, C: int, heads: list[torch.Tensor]):
        self.C, self.heads, self.rank, self.gathers = C, heads, 0, 0

    def size(self):
        return self.C

    def get_rank(self, group):
        assert group is self
        return self.rank

    def get_world_size(self, group):
        assert group is self
        return self.C

    def all_gather(self, parts, tensor, group):
        assert group is self and len(parts) == self.C
        torch.testing.assert_close(tensor, self.heads[self.rank], rtol=0, atol=0)  # this rank's own part
        for part, head in zip(parts, self.heads):
            part.copy_(head)
        self.gathers += 1


def _packed_segments(B, S, seed):
    """Documents of 3..11 positions (they span chunks and ranks), then padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    segment_ids = torch.full((B, S), -1)
    for b in range(B):
        t, doc = 0, 0
        while t < S - 2:
            n = int(torch.randint(3, 12, (1,), generator=g))
            segment_ids[b, t: t + n] = doc
            t, doc = t + n, doc + 1
    return segment_ids


@pytest.mark.parametrize("C, types", [(2, "all"), (3, ("e2e_tv", "ce"))], ids=["C2-every-type", "C3"])
def test_mtp_loss_context_parallel_shards_match_whole_row(megatron_single_process, monkeypatch, C, types):
    from megatron.core import parallel_state

    import bebop_megatron.training.loss as loss_module
    from bebop_megatron.config import LossConfig
    from bebop_megatron.config.loader import LOSS_TYPES
    from bebop_megatron.model.cp_attention import shard_sequence, unshard_sequence
    from bebop_megatron.training.loss import mtp_loss

    B, S, H, V, K = 2, 24, 8, 23, 3  # chunks of S / 2C = 6 or 4 >= K positions
    hidden_64, weight_64, batch = _make_case(B, S, H, V, K, seed=13, mask=_random_mask(2, S, 13, p_hole=0.15))
    batch.segment_ids = _packed_segments(B, S, seed=13)
    hidden = hidden_64.float()
    steps = hidden.chunk(1 + K, dim=0)  # backbone, then the K MTP steps: [S, B, H] each
    local = [torch.cat([shard_sequence(x, r, C, dim=0) for x in steps]) for r in range(C)]
    heads = [torch.stack([half[:K] for half in shard_sequence(steps[0], r, C, dim=0).chunk(2)]) for r in range(C)]
    model = StandInModel(weight_64.float())
    types = LOSS_TYPES if types == "all" else types
    checked = 0
    for loss_type in types:
        cfg = LossConfig(type=loss_type, target_temperature=0.8, draft_temperature=1.2, chunk_tokens=13, lk_eta=2.0)
        whole = hidden.clone().requires_grad_(True)
        ref_sum, ref_count, ref_stats = mtp_loss(model, whole, batch, K, megatron_single_process, cfg, vocab_size=V)
        ref_sum.backward()
        group = _FakeCPGroup(C, heads)
        with monkeypatch.context() as patch:
            patch.setattr(parallel_state, "get_context_parallel_group", lambda check_initialized=True: group)
            patch.setattr(loss_module, "dist", group)
            got_sum, got_count, got_stats, grads = 0.0, 0, 0.0, []
            for rank in range(C):
                group.rank = rank
                x = local[rank].clone().requires_grad_(True)
                loss_sum, count, stats = mtp_loss(model, x, batch, K, megatron_single_process, cfg, vocab_size=V)
                loss_sum.backward()
                got_sum, got_count, got_stats = got_sum + loss_sum, got_count + int(count), got_stats + stats
                grads.append(x.grad.chunk(1 + K, dim=0))
        assert group.gathers == C, loss_type
        assert ref_count > 0 and got_count == int(ref_count), loss_type
        torch.testing.assert_close(got_sum, ref_sum, rtol=1e-5, atol=1e-6, msg=loss_type)
        torch.testing.assert_close(got_stats, ref_stats, rtol=1e-5, atol=1e-5, msg=loss_type)
        got_grad = torch.cat([unshard_sequence([g[i] for g in grads], dim=0) for i in range(1 + K)])
        assert whole.grad.abs().max() > 0, loss_type
        torch.testing.assert_close(got_grad, whole.grad, rtol=1e-4, atol=1e-6, msg=loss_type)
        checked += 1
    assert checked == len(types) and len(LOSS_TYPES) == 9
