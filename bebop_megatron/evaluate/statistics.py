"""The acceptance statistics of one micro-batch: the model's hidden states of whole rows, draft and
target logits per MTP step through the shared output layer, and every position's acceptance added to
an :class:`bebop_megatron.metrics.report.AcceptanceReport` (``tools/eval_acceptance.py`` and the
objective study's held-out evaluation share it).

Plain-torch equivalent of one step k at position s (one rank, no padding)::
    q = softmax(W @ h_k[s] / T); p = softmax(W @ h_0[s + k] / T)
    alpha_RS = sum(min(p, q)); alpha_TO = p[argmax q]    # valid where chain_valid(...)[k, s]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from bebop_megatron.chain.masks import chain_valid
from bebop_megatron.data import attention_mask
from bebop_megatron.metrics import acceptance_rows
from bebop_megatron.model.builder import output_weight_of
from bebop_megatron.model.cp_attention import shard_sequence, unshard_sequence


def micro_batch_statistics(model, batch, report, args, *, K, tp_group, sim_budget, generator, device, vocab_size,
                           temperature_indices=None):
    """Add one micro-batch to ``report`` at the temperatures ``temperature_indices`` (default:
    all); returns the number of positions simulated.

    Columns from ``vocab_size`` on (Megatron's vocabulary padding) are excluded everywhere."""
    mask = attention_mask(batch.segment_ids)
    batch = batch.to(device)
    with torch.no_grad():
        hidden = whole_row_hidden(model, batch, None if mask is None else mask.to(device), K)
    S, B = batch.tokens.shape[1], batch.tokens.shape[0]
    chunks = torch.chunk(hidden, 1 + K, dim=0)  # [S, B, H] each: backbone, then MTP steps 1..K
    weight_VH = output_weight_of(model).float()
    H = hidden.shape[-1]
    chain_KN = chain_valid(batch.loss_mask, K, batch.segment_ids).transpose(1, 2).reshape(K, S * B)
    draft_KNH = torch.stack([c.reshape(S * B, H) for c in chunks[1:]]).float()
    # Step k at s is verified against the backbone at s+k; labels[s+k] is its data token.
    target_KNH = hidden.new_zeros((K, S, B, H), dtype=torch.float32)
    labels_KN = torch.zeros((K, S, B), dtype=torch.long, device=hidden.device)
    labels_SB = batch.labels.t()
    for k in range(1, K + 1):
        target_KNH[k - 1, : S - k] = chunks[0][k:].float()
        labels_KN[k - 1, : S - k] = labels_SB[k:]
    target_KNH, labels_KN = target_KNH.reshape(K, S * B, H), labels_KN.reshape(K, S * B)

    temps = list(range(len(report.temperatures))) if temperature_indices is None else list(temperature_indices)
    # The acceptance given the realized token and alpha_RS of every position, [K, S * B] per temperature.
    given = {ti: {mode: torch.zeros(K, S * B, dtype=torch.float64) for mode in ("rs", "to", "alpha_rs")}
             for ti in temps}
    positions = chain_KN[0].nonzero(as_tuple=True)[0]
    for start in range(0, len(positions), args.chunk_positions):
        idx = positions[start : start + args.chunk_positions]
        draft_logits, target_logits = draft_KNH[:, idx] @ weight_VH.t(), target_KNH[:, idx] @ weight_VH.t()
        for ti in temps:
            tau = report.temperatures[ti]
            rows = acceptance_rows(draft_logits, target_logits, tp_group=tp_group, target_temperature=tau,
                                   draft_temperature=tau, vocab_size=vocab_size, labels=labels_KN[:, idx])
            report.add_rows(ti, rows, chain_KN[:, idx], labels_KN[:, idx])
            cpu_idx = idx.cpu()
            for mode, key in (("rs", "accept_rs_label"), ("to", "accept_to_label"), ("alpha_rs", "alpha_rs")):
                given[ti][mode][:, cpu_idx] = rows[key].double().cpu()
    chain_KBS = chain_KN.view(K, S, B).transpose(1, 2).cpu()
    for ti in temps:
        per_mode = {mode: v.view(K, S, B).transpose(1, 2) for mode, v in given[ti].items()}
        report.add_decode(ti, per_mode, chain_KBS, batch.loss_mask, batch.segment_ids, batch.position_ids)
        report.add_position_rows(ti, per_mode["alpha_rs"], chain_KBS, batch.position_ids)

    G = report.G
    sim_idx = chain_KN[G - 1].nonzero(as_tuple=True)[0][:sim_budget]
    if len(sim_idx):
        draft_logits = gather_vocab(draft_KNH[:G, sim_idx] @ weight_VH.t(), tp_group)[..., :vocab_size]  # [G, n, V]
        target_logits = gather_vocab(target_KNH[:G, sim_idx] @ weight_VH.t(), tp_group)[..., :vocab_size]
        for ti in temps:
            tau = report.temperatures[ti]
            q = torch.softmax(draft_logits.double() / tau, -1).transpose(0, 1).contiguous()
            p = torch.softmax(target_logits.double() / tau, -1).transpose(0, 1).contiguous()
            report.simulate(ti, p, q, args.sim_trials, generator)
    return len(sim_idx)


def whole_row_hidden(model, batch, mask, K: int):
    """The model's hidden states ``[(1 + K) * S, B, H]`` of whole rows. Under context parallelism
    the forward runs this CP rank's chunks of the rows (as the trainer's) and the backbone's and
    every MTP step's hidden states are all-gathered over the CP group and put back in row order,
    so every CP rank computes the statistics of the whole rows."""
    C = parallel_state.get_context_parallel_world_size()
    if C == 1:
        return model(batch.tokens, batch.position_ids, mask)
    rank, group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
    local = model(*(shard_sequence(x, rank, C) for x in (batch.tokens, batch.position_ids)), mask)
    steps = []
    for part in torch.chunk(local, 1 + K, dim=0):  # [2L, B, H]: backbone, then MTP steps 1..K
        parts = [torch.empty_like(part) for _ in range(C)]
        dist.all_gather(parts, part.contiguous(), group=group)
        steps.append(unshard_sequence(parts, dim=0))
    return torch.cat(steps)


def gather_vocab(logits_KnV, tp_group):
    """Vocab-parallel logits ``[..., V / TP]`` gathered into the whole vocabulary ``[..., V]``."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return logits_KnV
    parts = [torch.empty_like(logits_KnV) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits_KnV.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)
