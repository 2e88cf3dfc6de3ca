"""Acceptance metrics of MTP drafts (DESIGN.md section 1) and entropy fits.

- :func:`acceptance_stats`: per MTP step alpha_RS, alpha_TO, H(p), H(q), KL(p||q), top-1
  and the expected accepted length E[L](g) for RS and TO, vocabulary-parallel, reduced over
  data-parallel ranks.
- :func:`accept_length_sums`: E[L](g) summed per position from per-step alphas and a chain
  mask (for the training loss's logging).
- :mod:`bebop_megatron.chain.decode_exact`: what speculative decoding will measure, from
  text sampled from the target (the decode-exact E[L], a recursion over positions).
- :mod:`bebop_megatron.metrics.entropy`: line fits against entropy and the RL drift split (Eq. 16).
"""

from bebop_megatron.metrics.acceptance import (
    ROW_KEYS,
    STAT_KEYS,
    accept_length_rows,
    accept_length_sums,
    acceptance_rows,
    acceptance_stats,
    acceptance_sums,
    means_of,
    reduce_sums,
)
from bebop_megatron.chain.decode_exact import decode_exact_rows, per_text_sums, ratio_interval, run_starts
from bebop_megatron.metrics.entropy import (
    DriftSplit,
    binned_means,
    entropy_mismatch_split,
    fit_line,
    line_from_moments,
)

__all__ = [
    "DriftSplit", "ROW_KEYS", "STAT_KEYS", "accept_length_rows", "accept_length_sums", "acceptance_rows",
    "acceptance_stats", "acceptance_sums", "binned_means", "decode_exact_rows", "entropy_mismatch_split", "fit_line",
    "line_from_moments", "means_of", "per_text_sums", "ratio_interval", "reduce_sums", "run_starts",
]
