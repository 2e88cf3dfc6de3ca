"""Tiny trained checkpoint: the cached Megatron model against the full forward, and measured
vs predicted accepted length; prints one JSON line (``tests/test_speculative_generate.py``)."""

from __future__ import annotations

import json
import sys

import torch

from bebop_megatron.speculative.megatron_model import MegatronSpecModel
from bebop_megatron.speculative.session import load, run_config


def full_forward(model, spec, toks, K):
    with torch.no_grad():
        hidden = model(torch.tensor([toks]), torch.arange(len(toks))[None], None)
    chunks = torch.chunk(hidden, 1 + K, 0)
    return [c[:, 0].float() @ spec.weight_VH.t() for c in chunks]  # backbone, step 1..K


def main(argv: list[str]) -> None:
    model, cfg = load(argv[0])
    spec = MegatronSpecModel(model, cfg.model.vocab_size)
    K = spec.num_steps
    toks = torch.randint(0, cfg.model.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    full = full_forward(model, spec, toks, K)
    # Backbone through prefill + verifications of several sizes with rollbacks; the draft chain
    # fed the true next tokens must give the full forward's step-k logits at c-1.
    spec.prefill(toks[:10])
    c, draft_diff = 10, 0.0
    for num in (0, 2, 1, 3, 0, 0, 3, 2, 1):
        step = [0]

        def pick(_logits):
            step[0] += 1
            return toks[c + step[0]]

        _, q = spec.draft(toks[: c + 1], K, pick)
        draft_diff = max(draft_diff, max((q[k] - full[k + 1][c - 1]).abs().max().item() for k in range(K)))
        spec.verify(toks[c: c + K + 1])
        spec.keep(1 + num)
        c += 1 + num
    backbone_diff = (spec.logits(spec.h0) - full[0][:c]).abs().max().item()
    # Teacher forcing: recomputed from scratch, and reused from a generation's state.
    tf_diff = 0.0
    d, t = spec.teacher_forced_logits(toks, K, 5)
    for k in range(K):
        tf_diff = max(tf_diff, (d[k] - full[k + 1][5: 5 + d.shape[1]]).abs().max().item(),
                      (t[k] - full[0][5 + k + 1: 5 + k + 1 + t.shape[1]]).abs().max().item())
    # partial chains (the decode-exact forecast): step k's rows up to t = len-1-k, zeros after
    d, t = spec.teacher_forced_logits(toks, K, 5, partial=True)
    L = len(toks)
    assert d.shape[1] == L - 2 - 5 + 1
    for k in range(1, K + 1):
        n = L - 1 - k - 5 + 1
        tf_diff = max(tf_diff, (d[k - 1, :n] - full[k][5: 5 + n]).abs().max().item(),
                      (t[k - 1, :n] - full[0][5 + k: 5 + k + n]).abs().max().item())
        assert not d[k - 1, n:].any() and not t[k - 1, n:].any()
    prompts = [toks[:6], toks[10:18], toks[20:25], toks[30:40]]
    stats = {}
    for gamma in (1, K):
        r = run_config(spec, prompts, gamma=gamma, temperature=1.0, mode="rs", max_new_tokens=48, seed=1)
        r.pop("texts")
        stats[gamma] = r
    print(json.dumps({"backbone_max_diff": backbone_diff, "draft_max_diff": draft_diff,
                      "teacher_forced_max_diff": tf_diff, "runs": stats}))


if __name__ == "__main__":
    main(sys.argv[1:])
