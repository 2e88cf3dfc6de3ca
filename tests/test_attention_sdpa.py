"""``model.attention_backend=sdpa`` (fused SDPA) against ``unfused`` (Megatron's DotProductAttention).

Same weights, one micro-batch, fp32 on CPU (tests/helpers/attention_case.py): hidden states of
the backbone and every MTP step, the MTP loss and every MTP gradient agree to ~1e-6 relative for
causal rows, packed rows (several documents per row, padding), MHA, GQA (2:1 and 4:1), MLA and
the Qwen hybrid (Gated DeltaNet and gated attention). The sdpa path never creates an S x S
tensor (the unfused one does: heads x S x S scores). TP=2 with SP against the unfused single
rank is a layout of tests/distributed/test_layouts.py; packed rows at TP=2 with SP in
tests/test_trainer_data.py.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.attention_case import CASES
from tests.helpers.launch import run_script

TOL = 1e-5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention") / "result.json"
    run_script("attention_case.py", ["--out", str(out)], nproc=1)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", [*CASES, "packed_dense_mask"])
def test_sdpa_matches_unfused(result, case):
    r = result[case]
    assert r["hidden"] < TOL and r["loss"] < TOL, r
    assert not r["grads_zero"] and len(r["grads"]) >= 10
    for name, err in r["grads"].items():
        assert err < 10 * TOL, (name, err)


def test_comparison_sees_attention_across_documents(result):
    r = result["packed_rows_as_causal"]
    assert r["hidden"] > 1e-3 and max(r["grads"].values()) > 1e-3


def test_sdpa_creates_no_sequence_squared_tensor(result):
    """Largest tensor of a forward and backward over one row of S tokens (4 heads)."""
    m = result["memory"]
    S = m["S"]
    assert m["sdpa_causal"] < S * S and m["sdpa_packed"] < S * S, m  # the largest: an [S, 2 * ffn] activation
    assert m["unfused_causal"] >= 4 * S * S and m["unfused_packed"] >= 4 * S * S, m  # the check sees S x S


def test_backend_setting():
    from bebop_megatron.config import ConfigError, load_config

    assert load_config().model.attention_backend == "sdpa"
    with pytest.raises(ConfigError, match="model.attention_backend='flash' must be one of sdpa, unfused"):
        load_config(overrides=["model.attention_backend=flash"])


def test_document_starts_expand_to_the_segment_mask():
    """The ``[B, S]`` starts expand to the former mask (same segment and causal), and the Gated
    DeltaNet reads the same document starts from either form."""
    import torch

    from bebop_megatron.data.batches import attention_mask, dense_attention_mask, document_starts

    seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 1, 1, 1]])
    starts = attention_mask(seg)
    assert starts.shape == seg.shape and starts.dtype == torch.bool
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    former = ~((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
    assert torch.equal(dense_attention_mask(starts), former)
    assert document_starts(starts) == document_starts(former) == [[0, 3, 5, 6], [0, 5]]
    assert attention_mask(torch.tensor([[0, 0, 0, -1]])) is None  # one document: plain causal
