"""Expected speed-up of speculative decoding with MTP drafts: a cost model.

For a chain of gamma drafts, one decoding iteration runs gamma MTP steps (one draft token
each) and one target forward that verifies the gamma drafts (gamma + 1 positions), and emits
1 + L tokens: the L accepted drafts plus one token from the target (the resample on a
rejection, or the bonus token when all gamma are accepted). Plain decoding emits one token
per target forward. So, in units of one target forward::

    speed-up(gamma) = (1 + E[L](gamma)) / (1 + gamma * c_draft / c_target + overhead)

- ``E[L](gamma)``: expected accepted drafts per verification: the decode-exact forecast
  (``accept_len_decode_rs`` / ``_to`` of :class:`bebop_megatron.metrics.report.AcceptanceReport`)
  where the report marks the temperature ``decode_exact`` (text sampled from the backbone at
  that temperature), else Eq. 12, sum_{j<=gamma} prod_{i<=j} alpha_i per position, averaged
  over positions (``accept_len_rs`` / ``accept_len_to``), which overstates decoding; each
  row names the one it used (``accept_len_used``);
- ``c_target``: time of one target forward that verifies gamma + 1 tokens (taken equal to a
  plain decoding step, as in memory-bound decoding and with a prefix much longer than gamma);
- ``c_draft``: time of one MTP step (one draft token);
- ``overhead``: everything else per iteration (sampling, acceptance test, scheduling), as a
  fraction of ``c_target`` (``overhead_ms / target_ms``).

E[L] is only known for the measured draft positions (the chain of ``mtp.num_steps`` steps):
the table stops there, with no extrapolation beyond it. :func:`measure_costs` times the
checkpoint's own model (medians of timed forwards after warm-up, one sequence, the full
prefix recomputed: no KV cache; one thread's CPU time on CPU); users give their GPU's numbers instead
(:class:`Costs`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass


@dataclass
class Costs:
    target_ms: float | None
    """One target verification forward (ms); None when only the ratio is known."""
    draft_ms: float | None
    """One MTP step (ms); None when only the ratio is known."""
    draft_ratio: float
    """c_draft / c_target."""
    overhead: float = 0.0
    """Per-iteration overhead as a fraction of c_target."""
    source: str = "given"
    """``measured`` (this machine, :func:`measure_costs`), ``given`` (milliseconds) or ``ratio``."""
    method: str = ""
    """How the times were obtained (shown in the report)."""

    @classmethod
    def from_times(cls, target_ms: float, draft_ms: float, overhead_ms: float = 0.0, source="given", method=""):
        if not target_ms > 0 or draft_ms < 0 or overhead_ms < 0:
            raise ValueError(f"cost times must be target > 0, draft >= 0, overhead >= 0 ms; got target {target_ms}, "
                             f"draft {draft_ms}, overhead {overhead_ms}")
        return cls(target_ms, draft_ms, draft_ms / target_ms, overhead_ms / target_ms, source, method)

    @classmethod
    def from_ratio(cls, draft_ratio: float, overhead: float = 0.0, method=""):
        if draft_ratio < 0 or overhead < 0:
            raise ValueError(f"--cost-ratio and the overhead must be >= 0, got {draft_ratio} and {overhead}")
        return cls(None, None, draft_ratio, overhead, "ratio", method)

    def to_dict(self) -> dict:
        return asdict(self)


def expected_speedup(accept_len: list[float], draft_ratio: float, overhead: float = 0.0) -> list[float]:
    """Entry g-1: speed-up(g) = (1 + E[L](g)) / (1 + g * c_draft / c_target + overhead), float64."""
    return [(1.0 + float(e)) / (1.0 + g * float(draft_ratio) + float(overhead))
            for g, e in enumerate(accept_len, start=1)]


def best_gamma(speedups: list[float]) -> tuple[int, float]:
    """``(gamma, speed-up)`` of the best chain length; ``(0, 1.0)`` (plain decoding) when no gamma
    beats it. Ties go to the shorter chain."""
    best = (0, 1.0)
    for g, s in enumerate(speedups, start=1):
        if s > best[1]:
            best = (g, s)
    return best


def speedup_table(per_temperature: dict, costs: Costs, num_positions: int) -> dict:
    """Speed-up per temperature and gamma for both verification methods, and the recommendation.

    ``per_temperature``: :meth:`AcceptanceReport.summary` (``accept_len_rs`` / ``_to`` for
    gamma = 1..G); ``num_positions``: the measured draft positions (``mtp.num_steps``)."""
    out = {"costs": costs.to_dict(), "formula": "(1 + E[L](gamma)) / (1 + gamma * c_draft / c_target + overhead)",
           "per_temperature": {}}
    G = None
    for tau, entry in per_temperature.items():
        exact = bool(entry.get("decode_exact")) and all(
            v is not None for which in ("rs", "to") for v in entry.get(f"accept_len_decode_{which}", [None]))
        row = {"accept_len_used": "decode-exact" if exact else "Eq. 12 over every position"}
        for which in ("rs", "to"):
            accept_len = entry[f"accept_len_decode_{which}" if exact else f"accept_len_{which}"]
            speedups = expected_speedup(accept_len, costs.draft_ratio, costs.overhead)
            gamma, best = best_gamma(speedups)
            row[f"speedup_{which}"] = speedups
            row[f"best_gamma_{which}"], row[f"best_speedup_{which}"] = gamma, best
        G = len(row["speedup_rs"])
        row["gamma"] = list(range(1, G + 1))
        out["per_temperature"][tau] = row
    out["max_gamma"] = G
    out["note"] = (f"gamma 1..{G}: E[L] is measured for {num_positions} draft positions (mtp.num_steps); longer chains "
                   "are not extrapolated" + (f" (pass --gamma {num_positions} to consider them all)"
                                             if G is not None and G < num_positions else ""))
    return out


def measure_costs(model, *, context: int, gamma: int, repeats: int = 5, warmup: int = 2, device="cpu",
                  vocab_size: int | None = None, barrier=None) -> Costs:
    """Time the checkpoint's model on this machine: medians over ``repeats`` after ``warmup``.

    One sequence of ``context`` tokens, the full prefix recomputed (no KV cache). Target forward:
    the backbone over the prefix plus the logits of its last gamma + 1 positions (a verification).
    Draft step: (the full model with its K MTP steps, each with the logits of its last position,
    minus the target forward) / K. Each repeat times the two back to back, so that both see the
    same machine; the draft step is the median of the per-repeat differences. On CPU the forwards
    run on one thread and the clock is that thread's CPU time (other load on a shared machine
    does not count, nor do idle threads spinning); on CUDA the wall time after a synchronize.
    ``barrier``: called before each timed forward (tensor-parallel ranks)."""
    import torch

    K = model.config.mtp_num_layers
    tokens = torch.randint(0, vocab_size or 2, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    position_ids = torch.arange(context, device=device).unsqueeze(0)
    on_cpu = str(device) == "cpu"
    clock = time.thread_time if on_cpu else time.perf_counter
    threads = torch.get_num_threads()

    def timed(with_mtp: bool) -> float:
        if barrier is not None:
            barrier()
        model.mtp_process = with_mtp
        start = clock()
        hidden = model(tokens, position_ids, None)
        chunks = torch.chunk(hidden, 1 + K, dim=0) if with_mtp else (hidden,)
        model.output_layer(chunks[0][-(gamma + 1):], weight=model.output_weight())
        for chunk in chunks[1:]:
            model.output_layer(chunk[-1:], weight=model.output_weight())
        if not on_cpu:
            torch.cuda.synchronize()
        return (clock() - start) * 1e3

    had_mtp = model.mtp_process
    targets, drafts = [], []
    try:
        if on_cpu:
            torch.set_num_threads(1)
        with torch.no_grad():
            for i in range(warmup + repeats):
                target_ms, full_ms = timed(False), timed(True)
                if i >= warmup:
                    targets.append(target_ms)
                    drafts.append((full_ms - target_ms) / K)
    finally:
        model.mtp_process = had_mtp
        torch.set_num_threads(threads)
    method = (f"measured here: medians of {repeats} repeats after {warmup} warm-up, "
              f"{'CPU time of one thread' if on_cpu else 'wall time'}, one sequence of {context} tokens, full prefix "
              f"recomputed (no KV cache); target = backbone + logits of {gamma + 1} positions, draft step = "
              f"(model with {K} MTP steps - target) / {K}")
    return Costs.from_times(statistics.median(targets), max(statistics.median(drafts), 0.0), 0.0, source="measured",
                            method=method)
