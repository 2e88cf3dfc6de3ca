"""Key-map units (no Megatron, in process): fused QKV layout, config checks, padding."""

from __future__ import annotations

import pytest
import torch

from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.hf_config import LayerShape, describe, padded_vocab
from bebop_megatron.convert.layers import fuse_qkv, split_qkv

SHAPE = LayerShape(hidden_size=12, num_heads=6, num_kv_heads=2, head_dim=2, ffn_hidden_size=8,
                   qkv_bias=True, qk_norm=False)


def test_fused_qkv_is_grouped_per_kv_head_and_splits_back():
    q = torch.arange(12).repeat_interleave(1).view(12, 1).float()  # rows: head h dims 2h, 2h+1
    k = 100 + torch.arange(4).view(4, 1).float()
    v = 200 + torch.arange(4).view(4, 1).float()
    fused = fuse_qkv(q, k, v, SHAPE)
    # group 0: q heads 0-2 (rows 0-5), k head 0, v head 0; group 1: q heads 3-5, k 1, v 1
    assert fused.flatten().tolist() == [0, 1, 2, 3, 4, 5, 100, 101, 200, 201,
                                        6, 7, 8, 9, 10, 11, 102, 103, 202, 203]
    for a, b in zip(split_qkv(fused, SHAPE), (q, k, v)):
        assert torch.equal(a, b)
    bias = fuse_qkv(q.flatten(), k.flatten(), v.flatten(), SHAPE)  # 1-d tensors (biases) too
    assert torch.equal(bias, fused.flatten())


def test_padded_vocab_is_layout_independent():
    assert padded_vocab(151936, 128, 8) == 152576 and padded_vocab(96, 128, 2) == 256
    rows = padded_vocab(1000, 128, 8)
    for tp in (1, 2, 4, 8):  # the builder's padding (multiple of 128 * tp) leaves it unchanged
        assert -(-rows // (128 * tp)) * (128 * tp) == rows


BASE = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 96}


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unknown architecture 'GPT2LMHeadModel'"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "rope_interleave": False}, "rope_interleave=false"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "only SwiGLU"),
    ({"use_sliding_window": True, "sliding_window": 128}, "sliding-window"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_config_errors_name_the_problem(change, message):
    with pytest.raises(ConvertError, match=message):
        describe({**BASE, **change})


def test_glm_group_routing_rule():
    glm = {**BASE, "architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 8, "moe_intermediate_size": 8,
           "num_experts_per_tok": 4, "n_group": 4, "topk_group": 1, "first_k_dense_replace": 1}
    with pytest.raises(ConvertError, match="num_experts_per_tok / topk_group == 2"):
        describe(glm)
    hf = describe({**glm, "topk_group": 2})
    assert hf.layer_at(0).num_experts == 0 and hf.layer_at(1).num_experts == 8 and hf.layer_at(2).expert_bias
