"""Reference chain verification for speculative decoding (DESIGN.md section 1).

- :func:`chain_rejection_sample`: drafts sampled from q, accepted with min(1, p/q),
  resampled from max(0, p - q) on rejection (acceptance alpha_RS = sum min(p, q)).
- :func:`chain_target_only`: greedy drafts argmax q, accepted with p(y), resampled from p
  without y (acceptance alpha_TO = p(argmax q)).

Both emit tokens distributed exactly as p; they are the ground truth for the tests and
for the empirical acceptance of ``tools/eval_acceptance.py``. ``batched_*`` run B
independent chains at once (same algorithm, same random stream for B = 1).

Whole-sequence speculative decoding with the trained heads (``tools/speculative_generate.py``):
:mod:`.decoding` (the draft / verify / accept loop over any model with four methods),
:mod:`.megatron_model` (the Megatron model with KV caches, one sequence),
:mod:`.batched_spec` (the same decoding for a batch of prompts over static caches), :mod:`.measure` (measured
acceptance against the teacher-forced Eq. 12 prediction), :mod:`.session` (loading, runs).
"""

from bebop_megatron.chain.sampling import (
    batched_rejection_sample,
    batched_target_only,
    chain_rejection_sample,
    chain_target_only,
    sample_drafts,
)

__all__ = [
    "batched_rejection_sample", "batched_target_only", "chain_rejection_sample", "chain_target_only",
    "sample_drafts",
]
