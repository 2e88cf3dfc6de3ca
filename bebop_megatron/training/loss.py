"""The MTP loss computed from the model's concatenated hidden states.

Legend: S sequence, B micro-batch, H hidden, K MTP steps, V_local this TP rank's vocab shard.

Step k (1..K) at position t predicts token x_{t+k+1} = labels[t+k]. It is valid when
t+k < S, loss_mask[t+k] is set and t+k is in t's document (packed rows); a chain stops at
its first invalid step (DESIGN.md section 1), so step k counts only where steps 1..k are
all valid.

Per position with K_t >= 1 valid leading steps, L_t = (1/K) sum_{k<=K_t} CE_k(t) for CE,
or the objective's L_t (e2e TV, Eq. 13; see :mod:`bebop_megatron.losses`); the loss is the
mean of L_t over such positions. The loss function returns the *sum* and the
count so that Megatron's per-token normalisation (``calculate_per_token_loss``) divides by
the count of the whole global batch, across micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from bebop_megatron.chain.decode_exact import decode_exact_rows, run_starts
from bebop_megatron.chain.masks import chain_valid, shift_targets
from bebop_megatron.config import LossConfig
from bebop_megatron.data import Batch
from bebop_megatron.losses import ACCEPT_LEN_KEYS, STAT_KEYS, chain_mask, fused_linear_objective
from bebop_megatron.model.builder import output_weight_of
from bebop_megatron.model.cp_attention import cp_chunk_ids, shard_sequence, unshard_sequence

# Decode-exact sums (held-out pass only; zeros otherwise): entry g-1 is gamma g's expected
# accepted drafts / verifications over the batch's texts (bebop_megatron.chain.decode_exact).
DECODE_ROWS = ("decode_accepted_rs", "decode_verifications_rs", "decode_accepted_to", "decode_verifications_to")
STAT_ROWS = ("ce_sum", "top1_correct", "count", *STAT_KEYS, *ACCEPT_LEN_KEYS, *DECODE_ROWS)


def _full_sequence(hidden_SBH: torch.Tensor, model, tp_group) -> torch.Tensor:
    """This rank's hidden states -> the full sequence, as the output layer's input.

    The backward sums the TP ranks' partial gradients (each rank holds one vocabulary shard
    of the output layer) and, under sequence parallelism, scatters them back to the shards.
    """
    if getattr(model.config, "sequence_parallel", False):
        return tensor_parallel.gather_from_sequence_parallel_region(
            hidden_SBH, tensor_parallel_output_grad=True, group=tp_group
        )
    return tensor_parallel.copy_to_tensor_model_parallel_region(hidden_SBH, group=tp_group)


class _ContextParallelLayout:
    """The fused loss's layout of this CP rank's positions (``parallel.context = C > 1``).

    The rank holds global chunks a = r and b = 2C-1-r (L positions each) of every row; the fused
    loss compares step k at t with the backbone at t+k, which for the last K positions of a chunk
    lies in the *next* global chunk (another rank's, or for r = C-1 this rank's other chunk). The
    loss therefore runs on ``[chunk a; K pad; chunk b; K pad]`` (2L + 2K positions): the pad rows
    are invalid draft positions, and in the backbone they hold the first K hidden states of the
    chunk that follows (all-gathered over the CP group; zeros after the row's end), so the
    fused loss's reads at t+1..t+K see the row's true backbone. Labels, loss masks and document
    ids are whole rows on every rank: chain validity and shifted targets are computed on the whole
    row, then sharded."""

    def __init__(self, K: int, group):
        self.K, self.group = K, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Whole-row tensor -> this rank's 2L positions along ``dim``."""
        return shard_sequence(x, self.rank, self.size, dim=dim)

    def pad(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """2L local positions along ``dim`` -> ``[a; K zeros; b; K zeros]``."""
        a, b = x.chunk(2, dim=dim)
        shape = list(x.shape)
        shape[dim] = self.K
        zeros = x.new_zeros(shape)
        return torch.cat([a, zeros, b, zeros], dim=dim)

    def backbone(self, local_SBH: torch.Tensor) -> torch.Tensor:
        """The backbone ``[2L, B, H]`` -> ``[a; first K of chunk a+1; b; first K of chunk b+1]``."""
        K, C = self.K, self.size
        a, b = local_SBH.chunk(2, dim=0)
        heads = torch.stack([a[:K], b[:K]]).contiguous()  # [2, K, B, H]
        parts = [torch.empty_like(heads) for _ in range(C)]
        dist.all_gather(parts, heads, group=self.group)

        def head_of(chunk: int) -> torch.Tensor:  # first K rows of global chunk `chunk`
            if chunk >= 2 * C:
                return torch.zeros_like(heads[0])
            return parts[chunk][0] if chunk < C else parts[2 * C - 1 - chunk][1]

        ca, cb = cp_chunk_ids(self.rank, C)
        return torch.cat([a, head_of(ca + 1), b, head_of(cb + 1)])

    def whole_rows(self, rows_2KN: torch.Tensor, B: int) -> torch.Tensor:
        """The fused loss's per-position rows ``[2, K, (2L + 2K) * B]`` (``label_rows``) of this
        rank -> those of the whole rows ``[2, K, S * B]``: pad positions dropped, all-gathered
        over the CP group and put back in row order."""
        K = self.K
        x = rows_2KN.detach().reshape(*rows_2KN.shape[:2], -1, B)
        L = x.shape[2] // 2 - K
        local = torch.cat([x[:, :, :L], x[:, :, L + K: 2 * L + K]], dim=2).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return unshard_sequence(parts, dim=2).flatten(2)


def mtp_loss(model, hidden, batch: Batch, num_steps: int, tp_group, loss_cfg: LossConfig,
             vocab_size: int | None = None, decode_exact: bool = False):
    """Returns ``(loss_sum, num_positions, stats)``; ``stats`` is ``[len(STAT_ROWS), K]`` sums.

    ``loss_cfg.type``: ``ce`` (the data tokens' cross-entropy of the raw draft logits, the loss
    of Megatron's MTP layers) or a distribution objective of :mod:`bebop_megatron.losses`
    against the frozen backbone (``e2e_tv``, ``tv``, ``kl``, ``reverse_kl``, and the cold-start
    ``nla``, ``e2e_nla``, ``lk``, ``e2e_lk`` with ``loss_cfg.lk_eta``); every one fused with the
    output projection: no full logits tensor is ever held. The acceptance statistics (alpha_RS,
    alpha_TO, entropies, KL) are computed for every objective, so runs compare directly.
    ``vocab_size`` (``model.vocab_size``): columns from it on are Megatron's vocabulary
    padding; every objective and statistic excludes them (logit -inf).
    ``decode_exact`` (the held-out pass): also the ``DECODE_ROWS`` sums, the decode-exact
    forecast on the batch's text for gamma = 1..K (exact where that text was sampled from the
    backbone at the loss's temperature; one more all-reduce per chunk; under context parallelism
    one all-gather of the per-position acceptance, the recursion on CP rank 0).
    """
    K = num_steps
    chunks = torch.chunk(hidden, 1 + K, dim=0)
    weight_VH = output_weight_of(model)
    labels_SB = batch.labels.t().contiguous()
    valid_KSB = chain_valid(batch.loss_mask, K, batch.segment_ids).transpose(1, 2)
    data_targets_KSB = shift_targets(labels_SB, K)  # step k at t predicts labels[t+k]
    cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    cp = _ContextParallelLayout(K, cp_group) if cp_group is not None and cp_group.size() > 1 else None
    whole_valid_KSB = valid_KSB
    if cp is not None:  # the batch holds whole rows; the hidden states this rank's chunks
        valid_KSB, data_targets_KSB = cp.shard(valid_KSB, 1), cp.shard(data_targets_KSB, 1)
    stats = torch.zeros(len(STAT_ROWS), K, dtype=torch.float32, device=hidden.device)
    stats[2] = valid_KSB.flatten(1).sum(-1).float()
    num_positions = valid_KSB[0].sum().to(torch.int)

    with torch.no_grad():  # the frozen backbone; step k's target is at t+k (shifted inside the loss)
        backbone_SBH = _full_sequence(chunks[0], model, tp_group)
    draft_KSBH = torch.stack([_full_sequence(chunks[k], model, tp_group) for k in range(1, K + 1)])
    fused_valid_KSB, fused_targets_KSB = valid_KSB, data_targets_KSB
    if cp is not None:
        with torch.no_grad():
            backbone_SBH = cp.backbone(backbone_SBH)
        draft_KSBH = cp.pad(draft_KSBH, 1)
        fused_valid_KSB, fused_targets_KSB = cp.pad(valid_KSB, 1), cp.pad(data_targets_KSB, 1)

    kwargs = dict(
        labels=fused_targets_KSB, tp_group=tp_group, target_temperature=loss_cfg.target_temperature,
        draft_temperature=loss_cfg.draft_temperature, reduction="sum",
        chunk_tokens=loss_cfg.chunk_tokens, return_stats=True, impl=loss_cfg.impl, vocab_size=vocab_size,
        lk_eta=loss_cfg.lk_eta, label_rows=decode_exact,
    )
    loss_sum, dist_stats = fused_linear_objective(loss_cfg.type, draft_KSBH, backbone_SBH, weight_VH,
                                                  fused_valid_KSB, **kwargs)
    if "ce_sum" in dist_stats:  # the data tokens' cross-entropy (ce)
        stats[0] = dist_stats["ce_sum"].float()
    stats[1] = dist_stats["top1"].float()
    for row, key in enumerate(STAT_KEYS + ACCEPT_LEN_KEYS, start=3):
        stats[row] = dist_stats[key].float()
    if decode_exact:
        # The recursion runs along whole rows: under CP the acceptance at every position is
        # gathered over the CP group in row order, and CP rank 0 alone adds the rows' sums.
        label_rows = dist_stats["label_rows"]
        if cp is not None:
            label_rows = cp.whole_rows(label_rows, valid_KSB.shape[2])
        if cp is None or cp.rank == 0:
            stats[STAT_ROWS.index(DECODE_ROWS[0]):] = decode_exact_sums(label_rows, whole_valid_KSB, batch,
                                                                        K).to(stats)
    return loss_sum.float(), num_positions, stats


def decode_exact_sums(label_rows_2KN: torch.Tensor, valid_KSB: torch.Tensor, batch: Batch, K: int) -> torch.Tensor:
    """``[4, K]`` (``DECODE_ROWS``): per gamma g = 1..K, the expected accepted drafts and
    verifications of RS and greedy (TO) decoding on the batch's text, from the acceptance given
    each realized token (``label_rows``: RS, TO, ``[2, K, S * B]``)."""
    S, B = valid_KSB.shape[1], valid_KSB.shape[2]
    given = label_rows_2KN.detach().view(2, K, S, B).transpose(2, 3).double().cpu()  # [2, K, B, S]
    chain = valid_KSB.transpose(1, 2).cpu()
    starts = run_starts(batch.loss_mask.cpu(), batch.segment_ids.cpu())
    out = torch.zeros(4, K, dtype=torch.float64)
    for m in range(2):
        for g in range(1, K + 1):
            acc, ver = decode_exact_rows(given[m], chain, starts, g)
            out[2 * m, g - 1], out[2 * m + 1, g - 1] = float(acc.sum()), float(ver.sum())
    return out


def mtp_ce_loss(model, hidden, batch: Batch, num_steps: int, tp_group, vocab_size: int | None = None):
    """:func:`mtp_loss` with Megatron-style cross-entropy on the data tokens."""
    return mtp_loss(model, hidden, batch, num_steps, tp_group, LossConfig(type="ce"), vocab_size=vocab_size)
