"""Streaming accumulation of the acceptance report (``tools/eval_acceptance.py``).

Legend: K MTP steps, n positions of one chunk, G gamma (drafts per chain, G <= K),
T temperatures, E entropy bins, V vocabulary.

Everything is a float64 sum, so chunks, micro-batches and data-parallel ranks add up
(:meth:`AcceptanceReport.reduce`) before :meth:`AcceptanceReport.summary` divides:

- per temperature and step: the :func:`acceptance_sums` (alpha_RS, alpha_TO, H(p), H(q),
  KL, top-1, E[L](g) per position, counts);
- per step and target-entropy bin: counts, alpha sums and how often RS beats target-only
  (d_TV(p, q) < 1 - p(argmax q), i.e. alpha_RS > alpha_TO);
- per step: the moments of the least-squares line alpha ~ a + b H(p) (Fig. 1a / Fig. 8);
- empirical accepted drafts of simulated chains (:mod:`bebop_megatron.speculative`) for
  gamma = 1..G: one simulation of G drafts gives every shorter chain too, since a chain of
  g drafts accepts min(accepted of G, g) under the same random numbers;
- a few (step, H(p), d_TV, 1 - p(argmax q)) points of this rank for the scatter plot;
- the decode-exact forecast (:mod:`bebop_megatron.chain.decode_exact`) per temperature,
  gamma = 1..G and verification method: the expected accepted drafts and verifications of each
  text (document), kept per text for the bootstrap over texts;
- by context position bucket (the chain's position in its document): alpha_RS per step and
  the decode-exact E[L](G) of RS, with counts.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from bebop_megatron.metrics.acceptance import acceptance_sums
from bebop_megatron.chain.decode_exact import decode_exact_rows, per_text_sums, ratio_interval, run_starts
from bebop_megatron.metrics.entropy import line_from_moments
from bebop_megatron.chain.sampling import batched_rejection_sample, batched_target_only, sample_drafts

SUM_KEYS = ("alpha_rs", "alpha_to", "entropy_target", "entropy_draft", "kl", "top1", "accept_len_rs",
            "accept_len_to", "count")
MOMENTS = ("n", "sx", "sxx", "sy_rs", "sxy_rs", "sy_to", "sxy_to")
POSITION_EDGES = (0, 512, 2048, 8192, 32768)  # context position buckets without a length: [0, 512), ..., [32768, inf)
POSITION_BUCKETS = 4  # with the data's longest row: that many equal buckets over it


def position_edges(max_position: int | None) -> tuple[int, ...]:
    """The context-position buckets' lower edges: :data:`POSITION_BUCKETS` equal ones over
    ``[0, max_position)`` (the rows' length: every bucket can hold positions), or the fixed
    :data:`POSITION_EDGES` when the length is not known. The last bucket is open above."""
    if max_position is None:
        return POSITION_EDGES
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    return tuple(sorted({max_position * i // POSITION_BUCKETS for i in range(POSITION_BUCKETS)}))
DECODE_MODES = ("rs", "to")


class AcceptanceReport:
    def __init__(self, temperatures, num_steps: int, gamma: int, entropy_edges, num_scatter: int = 2000,
                 keep_positions: bool = False, max_position: int | None = None):
        if not 1 <= gamma <= num_steps:
            raise ValueError(f"gamma must be in 1..{num_steps} (the checkpoint's MTP steps), got {gamma}")
        self.temperatures = [float(t) for t in temperatures]
        self.K, self.G = num_steps, gamma
        self.edges = torch.as_tensor(entropy_edges, dtype=torch.float64)
        T, K, E = len(self.temperatures), num_steps, len(self.edges) - 1
        f64 = dict(dtype=torch.float64)
        self.sums = torch.zeros(T, len(SUM_KEYS), K, **f64)
        self.bins = torch.zeros(T, 4, K, E, **f64)  # count, sum alpha_rs, sum alpha_to, RS wins
        self.moments = torch.zeros(T, len(MOMENTS), K, **f64)
        self.sim = torch.zeros(T, 3, gamma, **f64)  # chains, accepted RS, accepted TO (per gamma)
        self.num_scatter = num_scatter
        self.scatter = [[] for _ in range(T)]
        # Per-position rows (for bootstrap intervals over positions): [K, n] chunks per temperature.
        self.keep_positions = keep_positions
        self.positions = [[] for _ in range(T)]
        # Decode-exact: per temperature, [texts, mode, gamma, (accepted, verifications)] chunks of this rank.
        self.decode = [[] for _ in range(T)]
        self.position_edges = position_edges(max_position)
        self.max_position = max_position
        P = len(self.position_edges)
        self.by_position = torch.zeros(T, 2, K, P, **f64)  # per step: chains reaching it, alpha_RS sums
        self.by_position_decode = torch.zeros(T, 2, P, **f64)  # decode-exact RS at G: accepted, verifications

    # ------------------------------------------------------------------ updates

    def add_rows(self, ti: int, rows: dict, chain_Kn: torch.Tensor, labels_Kn=None) -> None:
        """Add one chunk's :func:`acceptance_rows` output at temperature index ``ti``."""
        chain_Kn = chain_Kn.cpu()
        rows = {k: v.detach().cpu() for k, v in rows.items()}
        sums = acceptance_sums(rows, chain_Kn, None if labels_Kn is None else labels_Kn.cpu())
        if labels_Kn is None:
            sums["top1"] = torch.zeros_like(sums["count"])
        self.sums[ti] += torch.stack([sums[k].double() for k in SUM_KEYS])
        chain = chain_Kn.double()
        h, a_rs, a_to = (rows[k].double() * chain for k in ("entropy_target", "alpha_rs", "alpha_to"))
        self.moments[ti] += torch.stack([chain, h, h * h, a_rs, h * a_rs, a_to, h * a_to]).sum(-1)
        E = len(self.edges) - 1
        index = (torch.searchsorted(self.edges, rows["entropy_target"].double().contiguous(), right=True) - 1)
        index = index.clamp_(0, E - 1)
        wins = (rows["alpha_rs"] > rows["alpha_to"]).double()
        for c, w in enumerate((chain, a_rs, a_to, wins * chain)):
            self.bins[ti, c].scatter_add_(1, index, w)
        if self.keep_positions:
            self.positions[ti].append({"chain": chain_Kn.clone(),
                                       **{k: rows[k].float().clone() for k in ("alpha_rs", "alpha_to", "entropy_target")}})
        room = self.num_scatter - len(self.scatter[ti])
        if room > 0:
            k_idx, t_idx = chain_Kn.nonzero(as_tuple=True)
            for k, t in list(zip(k_idx.tolist(), t_idx.tolist()))[:room]:
                self.scatter[ti].append((k + 1, float(rows["entropy_target"][k, t]),
                                         1.0 - float(rows["alpha_rs"][k, t]), 1.0 - float(rows["alpha_to"][k, t])))

    def add_decode(self, ti: int, accept_KBS: dict, chain_KBS, loss_mask_BS, segment_ids_BS, position_ids_BS) -> None:
        """Add one micro-batch's decode-exact sums at temperature index ``ti``: ``accept_KBS``
        maps ``rs`` / ``to`` to the acceptance given the realized token ``[K, B, S]``
        (:func:`bebop_megatron.metrics.acceptance_rows` with labels), ``chain_KBS`` the chain mask."""
        starts = run_starts(loss_mask_BS.cpu(), segment_ids_BS.cpu())
        chain = chain_KBS.cpu()
        seg = segment_ids_BS.cpu().numpy()
        keep = chain[0].numpy()
        per_text = None
        for m, mode in enumerate(DECODE_MODES):
            for g in range(1, self.G + 1):
                acc, ver = decode_exact_rows(accept_KBS[mode], chain, starts, g)
                sums = np.stack([per_text_sums(acc, seg, keep), per_text_sums(ver, seg, keep)], -1)
                if per_text is None:
                    per_text = np.zeros((len(sums), len(DECODE_MODES), self.G, 2))
                per_text[:, m, g - 1] = sums
                if mode == "rs" and g == self.G:
                    bucket = self._position_bucket(position_ids_BS.cpu().numpy())
                    for i in range(len(self.position_edges)):
                        sel = bucket == i
                        self.by_position_decode[ti, 0, i] += float(acc[sel].sum())
                        self.by_position_decode[ti, 1, i] += float(ver[sel].sum())
        if per_text is not None and len(per_text):
            self.decode[ti].append(torch.from_numpy(per_text))

    def add_position_rows(self, ti: int, alpha_rs_KBS, chain_KBS, position_ids_BS) -> None:
        """alpha_RS per step and context-position bucket (sums and chain counts)."""
        bucket = torch.from_numpy(self._position_bucket(position_ids_BS.cpu().numpy()))
        chain = chain_KBS.cpu().double()
        alpha = alpha_rs_KBS.cpu().double() * chain
        for i in range(len(self.position_edges)):
            sel = (bucket == i).double()
            self.by_position[ti, 0, :, i] += (chain * sel).flatten(1).sum(-1)
            self.by_position[ti, 1, :, i] += (alpha * sel).flatten(1).sum(-1)

    def simulate(self, ti: int, target_probs_nGV, draft_probs_nGV, trials: int, generator) -> None:
        """Run ``trials`` RS and target-only chains of G drafts per position.

        ``target_probs``: ``[n, G, V]`` (step i's target p_i; the bonus row, which never
        changes the number of accepted drafts, repeats p_G); ``draft_probs``: ``[n, G, V]``.
        """
        n = target_probs_nGV.shape[0]
        if n == 0:
            return
        target = torch.cat([target_probs_nGV, target_probs_nGV[:, -1:]], dim=1)
        g = torch.arange(1, self.G + 1, device=target.device)
        for _ in range(trials):
            drafts = sample_drafts(draft_probs_nGV, generator)
            num_rs, _ = batched_rejection_sample(target, draft_probs_nGV, drafts, generator)
            num_to, _ = batched_target_only(target, draft_probs_nGV, generator)
            self.sim[ti, 0] += n
            self.sim[ti, 1] += torch.minimum(num_rs[:, None], g).sum(0).double().cpu()
            self.sim[ti, 2] += torch.minimum(num_to[:, None], g).sum(0).double().cpu()

    def position_rows(self, group=None) -> dict:
        """``{temperature key: {"chain", "alpha_rs", "alpha_to", "entropy_target": [K, N]}}`` over
        every position added (gathered from ``group``'s ranks; needs ``keep_positions``)."""
        parts = self.positions
        if group is not None and dist.get_world_size(group) > 1:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, parts, group=group)
            parts = [[chunk for rank_parts in gathered for chunk in rank_parts[ti]] for ti in range(len(parts))]
        out = {}
        for ti, tau in enumerate(self.temperatures):
            chunks = parts[ti]
            keys = ("chain", "alpha_rs", "alpha_to", "entropy_target")
            out[_key(tau)] = {k: torch.cat([c[k] for c in chunks], dim=1) if chunks else torch.zeros(self.K, 0)
                              for k in keys}
        return out

    def reduce(self, group) -> None:
        """Sum every accumulator over ``group`` (the data-parallel ranks)."""
        if group is None or dist.get_world_size(group) == 1:
            return
        for t in (self.sums, self.bins, self.moments, self.sim, self.by_position, self.by_position_decode):
            buf = t.to(_comm_device(group))
            dist.all_reduce(buf, group=group)
            t.copy_(buf.cpu())
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self.decode, group=group)
        self.decode = [[chunk for rank_parts in gathered for chunk in rank_parts[ti]] for ti in range(len(self.decode))]

    # ------------------------------------------------------------------ summary

    def decode_summary(self, ti: int) -> dict:
        """Decode-exact E[L](g) per verification method, its 95% bootstrap interval over texts,
        and the expected verifications (None where no text has a verification)."""
        parts = self.decode[ti]
        texts = torch.cat(parts).numpy() if parts else np.zeros((0, len(DECODE_MODES), self.G, 2))
        out = {"num_texts": int(texts.shape[0])}
        for m, mode in enumerate(DECODE_MODES):
            values, intervals = [], []
            for g in range(self.G):
                ratio, ci = ratio_interval(texts[:, m, g, 0], texts[:, m, g, 1], seed=g)
                values.append(ratio)
                intervals.append(ci)
            out[f"accept_len_decode_{mode}"] = values
            out[f"accept_len_decode_{mode}_ci95"] = intervals
            out[f"expected_verifications_{mode}"] = texts[:, m, :, 1].sum(0).tolist()
        return out

    def _position_bucket(self, position_ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self.position_edges), position_ids, side="right") - 1

    def position_summary(self, ti: int) -> dict:
        """By context-position bucket: chain counts, alpha_RS per step, decode-exact E[L](G) RS."""
        chains_KP, alpha_KP = self.by_position[ti]
        edges = self.position_edges
        last = f"{edges[-1]}-{self.max_position}" if self.max_position is not None else f"{edges[-1]}+"
        names = [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])] + [last]
        acc, ver = self.by_position_decode[ti]
        return {
            "buckets": names,
            "count": chains_KP[0].tolist(),
            "alpha_rs": [_masked(a / c.clamp(min=1), c) for a, c in zip(alpha_KP, chains_KP)],
            "accept_len_decode_rs": _masked(acc / ver.clamp(min=1e-300), ver),
            "verifications": ver.tolist(),
        }

    def summary(self) -> dict:
        out = {}
        for ti, tau in enumerate(self.temperatures):
            s = dict(zip(SUM_KEYS, self.sums[ti]))
            count = s["count"].clamp(min=1)
            entry = {k: (s[k] / count).tolist() for k in SUM_KEYS if k != "count"}
            entry["count"] = s["count"].tolist()
            entry["accept_len_rs"] = entry["accept_len_rs"][: self.G]
            entry["accept_len_to"] = entry["accept_len_to"][: self.G]
            chains = self.sim[ti, 0]
            entry["num_simulated_chains"] = int(chains[0])
            for c, name in ((1, "empirical_accept_len_rs"), (2, "empirical_accept_len_to")):
                entry[name] = _finite((self.sim[ti, c] / chains).tolist()) if chains[0] > 0 else [None] * self.G
            entry["entropy_fit"] = self._fits(ti)
            count_KE, rs_KE, to_KE, wins_KE = self.bins[ti]
            pooled = count_KE.sum(0).clamp(min=1)
            entry["entropy_bins"] = {
                "edges": self.edges.tolist(),
                "count": count_KE.sum(0).tolist(),
                "alpha_rs": _masked(rs_KE.sum(0) / pooled, count_KE.sum(0)),
                "alpha_to": _masked(to_KE.sum(0) / pooled, count_KE.sum(0)),
                "rs_win_fraction": _masked(wins_KE.sum(0) / pooled, count_KE.sum(0)),
                "rs_win_fraction_per_step": [_masked(w / c.clamp(min=1), c) for w, c in zip(wins_KE, count_KE)],
            }
            entry["rs_win_fraction"] = (wins_KE.sum(-1) / count_KE.sum(-1).clamp(min=1)).tolist()
            entry.update(self.decode_summary(ti))
            entry["by_position"] = self.position_summary(ti)
            out[_key(tau)] = entry
        return out

    def _fits(self, ti: int) -> dict:
        m = dict(zip(MOMENTS, self.moments[ti]))

        def fit(k, which):
            sel = (lambda v: v.sum()) if k is None else (lambda v: v[k])
            slope, intercept = line_from_moments(*(float(sel(m[n])) for n in ("n", "sx", f"sy_{which}", "sxx",
                                                                                 f"sxy_{which}")))
            return {"slope": _finite(slope), "intercept": _finite(intercept)}

        return {which: {**fit(None, which), "per_step": [fit(k, which) for k in range(self.K)]}
                for which in ("rs", "to")}


def _key(tau: float) -> str:
    return f"{tau:g}"


def _finite(x):
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x if x is not None and math.isfinite(x) else None


def _masked(values: torch.Tensor, counts: torch.Tensor) -> list:
    """JSON-safe: None for empty bins."""
    return [float(v) if c > 0 else None for v, c in zip(values.tolist(), counts.tolist())]




def _comm_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
