"""The step-to-step hand-off of the export (bebop_megatron/convert/handoff.py) and the generic
K-step reference chain (``verify.draft_chain``), without models: milliseconds.

The verified exports themselves (K=3 through one reused layer, K=2 through two layers, a
hand-off mismatch failing at step 2) are in tests/test_convert_export.py and
tests/test_convert_deepseek.py.
"""

from __future__ import annotations

import pytest
import torch

from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.formats import FORMATS
from bebop_megatron.convert.handoff import engine_handoff, mismatch_warning, num_draft_steps, trained_chain

# Pinned per format: (vLLM default, SGLang, what --vllm-handoff pre_norm gives or the refusal).
EXPECTED = {
    "mimo": ("post_norm", "post_norm", "vLLM's mimo draft hands the next step the post-norm state in every release"),
    "glm4_moe": ("post_norm", "post_norm", "pre_norm"),
    "deepseek": ("post_norm", "post_norm", "pre_norm"),
    "qwen3_next": ("post_norm", "post_norm",
                   "vLLM's qwen3_next draft hands the next step the post-norm state in every release"),
    "qwen3_5": ("post_norm", "post_norm", "vLLM's qwen3_5 draft hands the next step the post-norm state in every release"),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_engine_handoff_default_and_legacy(name):
    fmt = FORMATS[name]
    vllm, sglang, legacy = EXPECTED[name]
    assert engine_handoff(fmt, "vllm") == vllm and engine_handoff(fmt, "sglang") == sglang
    assert engine_handoff(fmt, "vllm", "post_norm") == "post_norm"
    if legacy in ("pre_norm", "post_norm"):
        assert engine_handoff(fmt, "vllm", "pre_norm") == legacy
    else:
        with pytest.raises(ConvertError, match=legacy):
            engine_handoff(fmt, "vllm", "pre_norm")
    with pytest.raises(ConvertError, match="--vllm-handoff applies to --target vllm only"):
        engine_handoff(fmt, "sglang", "pre_norm")
    with pytest.raises(ConvertError, match="unknown --vllm-handoff 'pre'"):
        engine_handoff(fmt, "vllm", "pre")


def test_a_format_without_engine_handoffs_is_post_norm():
    class NewFormat:  # a format that declares nothing
        name = "new"

    assert engine_handoff(NewFormat, "vllm") == "post_norm" == engine_handoff(NewFormat, "sglang")
    with pytest.raises(ConvertError):
        engine_handoff(NewFormat, "vllm", "pre_norm")


def test_trained_chain_and_num_steps(tmp_path):
    (tmp_path / "bebop_model.yaml").write_text("model: {}\nmtp:\n  num_layers: 1\n  num_steps: 5\n"
                                               "  next_step_input: pre_norm\n")
    chain = trained_chain(str(tmp_path), None)
    assert (chain.num_steps, chain.handoff) == (5, "pre_norm")
    # the training checkpoint's own config wins over a bebop_model.yaml
    chain = trained_chain(str(tmp_path), {"config_yaml": "mtp:\n  num_steps: 2\n"})
    assert (chain.num_steps, chain.handoff, chain.source) == (2, "post_norm", "the training config")
    nothing = trained_chain(str(tmp_path / "none"), None)
    assert (nothing.num_steps, nothing.handoff) == (None, "post_norm")
    assert num_draft_steps(None, chain, 1, True) == 2 and num_draft_steps(4, chain, 1, True) == 4
    assert num_draft_steps(None, nothing, 2, True) == 2  # one step per layer when nothing is recorded
    with pytest.raises(ConvertError, match="the checkpoint has 2 MTP layers, which the Megatron model runs as exactly"):
        num_draft_steps(3, nothing, 2, True)
    with pytest.raises(ConvertError, match="--num-speculative-tokens 0 must be >= 1"):
        num_draft_steps(0, nothing, 1, True)


def test_mismatch_warning_names_the_fix():
    deepseek, mimo = FORMATS["deepseek"], FORMATS["mimo"]
    line = mismatch_warning(deepseek, "pre_norm", "post_norm", "vllm")
    assert "trained with mtp.next_step_input=pre_norm, but vllm hands the next draft step the post-norm" in line
    assert "export with --vllm-handoff pre_norm" in line and "vLLM releases before PR #45895" in line
    line = mismatch_warning(deepseek, "post_norm", "pre_norm", "vllm")
    assert "serve with current vLLM (drop --vllm-handoff)" in line
    line = mismatch_warning(mimo, "pre_norm", "post_norm", "sglang")
    assert "--vllm-handoff" not in line and line.endswith("train with mtp.next_step_input=post_norm")


class _Toy:
    """A linear MTP stand-in: layer i maps (h, tokens) to y = h @ W_i + c_i[tokens]; its final
    "norm" scales by s_i. Enough to tell which layer and which hand-off each step used."""

    def __init__(self, num_layers: int, H: int = 4, V: int = 7):
        g = torch.Generator().manual_seed(0)
        self.num_layers = num_layers
        self.W = torch.randn(num_layers, H, H, generator=g, dtype=torch.float64)
        self.c = torch.randn(num_layers, V, H, generator=g, dtype=torch.float64)
        self.s = 1 + torch.rand(num_layers, H, generator=g, dtype=torch.float64)

    def step(self, i, h, tokens):
        y = h @ self.W[i] + self.c[i][tokens]
        return y, y * self.s[i]

    def logits(self, i, normed):
        return normed.sum(-1, keepdim=True) * (i + 1)


@pytest.mark.parametrize("num_layers,handoff", [(1, "post_norm"), (1, "pre_norm"), (3, "post_norm")])
def test_draft_chain_against_the_recursion(num_layers, handoff):
    """Step k uses layer (k-1) % num_layers on positions [0, S-k), the tokens k positions on,
    and the previous step's output after (post_norm) or before (pre_norm) the final norm."""
    from bebop_megatron.convert.reference_chain import draft_chain

    toy, S, K = _Toy(num_layers), 9, 3
    tokens = torch.randint(0, 7, (2, S), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, S, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = draft_chain(toy, hidden, tokens, K, handoff)
    h = hidden
    for k in range(1, K + 1):
        i = (k - 1) % num_layers
        y = h[:, : S - k] @ toy.W[i] + toy.c[i][tokens[:, k:]]
        normed = y * toy.s[i]
        assert torch.equal(got[k - 1], normed.sum(-1, keepdim=True) * (i + 1)), k
        h = y if handoff == "pre_norm" else normed
