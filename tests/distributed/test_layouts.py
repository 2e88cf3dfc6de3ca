"""Every parallel layout against the same model on one rank (2 gloo ranks, CPU).

The objective is the e2e TV loss (vocabulary-parallel under TP, sequence-parallel hidden
states under SP); one layout repeats TP+SP with the CE objective, two run the MTP chain with
``mtp.next_step_input=pre_norm`` (TP+SP, and a standalone MTP pipeline stage); one runs TP+SP
with the fused SDPA attention (``model.attention_backend=sdpa``, the default of every other
run) against the unfused Megatron attention on one rank. Multi-Latent Attention runs at TP=2
with and without SP (its decoupled rope key is one head shared by the heads of both ranks:
its rows of ``linear_kv_down_proj``'s gradient are compared on their own scale too). The Qwen3.5 /
Qwen3-Next hybrid (Gated DeltaNet layers, gated attention) runs at PP=2 and, as MoE, EP=2 (TP=2 with SP
of its Gated DeltaNet layers is checked on the imported models' logits, tests/test_convert_import.py).

Weights are independent of the layout: the single-rank reference writes its initial
weights as a Megatron distributed checkpoint, and each 2-rank run loads them at its own
layout (``model.init_checkpoint``; TP=2 loads only the backbone with
``model.backbone_checkpoint`` and relies on Megatron's CPU initialisation of the MTP
layer, which is TP-independent). Checked: loss at step 0 (relative 1e-5), the full MTP
gradients of step 0, the loss (and top-1) after 3 optimizer steps, backbone parameters
bit-identical after training, and an optimizer holding exactly the MTP parameters. Three
Adam updates are enough for that check: the learning rate is constant (no warmup) and the
loss falls by about a sixth over them (0.163 to 0.136 for the dense family), so an update
that differs between layouts shows in the loss well above the 1e-4 tolerance (halving the
learning rate on rank 1 alone fails that check in all 14 layouts that preceded the MLA ones).

The loss is chunked (``loss.chunk_tokens``) in every run. Under TP each chunk's kernel blocks
all-reduce their row statistics, and those all-reduces dominate a TP run's time on CPU:
``tp2_sp`` keeps the fine chunking of the references (37 tokens: two chunks of 18 and 14
positions, blocks of 4 rows), the other TP layouts use :data:`TP_CHUNK_TOKENS` (two chunks
of 31 and 1 positions, blocks of 7 rows: 10 kernel calls per MTP step and micro-batch
instead of 16), which also checks that the chunking does not change the result (their
references use 37).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launch import load_grads, run_cases

STEPS = 4  # the loss of step index 3 comes after 3 optimizer steps
TP_CHUNK_TOKENS = "loss.chunk_tokens=63"  # still two chunks of the 32 x 2 tokens of a micro-batch
BASE = [
    "device=cpu", f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.seq_length=32", "train.lr=3e-3", "train.warmup_fraction=0.0",
    "model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=200",
    "mtp.num_layers=1", "mtp.num_steps=3", "loss.type=e2e_tv", "loss.chunk_tokens=37",
]
QWEN_HYBRID = [
    "model.layer_types=[linear_attention,full_attention,linear_attention,full_attention]",
    "model.attention_output_gate=true", "model.zero_centered_norms=true", "model.qk_layernorm=true",
    "model.kv_channels=16", "model.rotary_percent=0.25", "model.linear_key_head_dim=8", "model.linear_value_head_dim=8",
    "model.linear_num_key_heads=2", "model.linear_num_value_heads=4",
]
MLA = [
    "model.multi_latent_attention=true", "model.num_query_groups=4", "model.q_lora_rank=32", "model.kv_lora_rank=16",
    "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=8", "model.qk_layernorm=true",
]
FAMILIES = {
    "dense": ["model.qk_layernorm=true"],
    "dense_ce": ["model.qk_layernorm=true", "loss.type=ce"],
    "dense_pre_norm": ["model.qk_layernorm=true", "mtp.next_step_input=pre_norm"],
    "dense_unfused": ["model.qk_layernorm=true", "model.attention_backend=unfused"],
    "moe": [
        "model.family=moe", "model.num_experts=4", "model.moe_router_topk=2", "model.add_qkv_bias=true",
        "model.ffn_hidden_size=64", "model.moe_shared_expert_intermediate_size=64",
    ],
    # Multi-Latent Attention (DeepSeek-V3 shapes, latent norms): under TP the rope key's 8 columns of
    # the 24 of linear_kv_down_proj lie on rank 1, shared by every rank's heads (model/mla.py)
    "mla": MLA,
    # Qwen3.5 / Qwen3-Next hybrid: Gated DeltaNet and gated-attention layers, zero-centred norms;
    # the MTP layer is gated attention (dense, or MoE with a gated shared expert).
    "qwen_hybrid": QWEN_HYBRID,
    "qwen_hybrid_moe": QWEN_HYBRID + [
        "model.family=moe", "model.num_experts=4", "model.moe_router_topk=2", "model.ffn_hidden_size=64",
        "model.moe_shared_expert_intermediate_size=64", "model.moe_shared_expert_gate=true",
    ],
}
# name -> (family, overrides, how the 2-rank run gets its weights)
LAYOUTS = {
    "tp2": ("dense", ["parallel.tensor=2", TP_CHUNK_TOKENS], "backbone_checkpoint"),
    "tp2_sp": ("dense", ["parallel.tensor=2", "parallel.sequence_parallel=true"], "init_checkpoint"),
    "tp2_sp_ce": (
        "dense_ce", ["parallel.tensor=2", "parallel.sequence_parallel=true", TP_CHUNK_TOKENS], "init_checkpoint"),
    "tp2_sp_sdpa_vs_unfused": (
        "dense_unfused",
        ["parallel.tensor=2", "parallel.sequence_parallel=true", "model.attention_backend=sdpa", TP_CHUNK_TOKENS],
        "init_checkpoint"),
    "pp2": ("dense", ["parallel.pipeline=2"], "init_checkpoint"),
    "pp2_standalone_mtp": ("dense", ["parallel.pipeline=2", "parallel.pipeline_layout=Et*4|m*3L"], "init_checkpoint"),
    "tp2_sp_pre_norm": (
        "dense_pre_norm", ["parallel.tensor=2", "parallel.sequence_parallel=true", TP_CHUNK_TOKENS], "init_checkpoint"),
    "pp2_standalone_mtp_pre_norm": (
        "dense_pre_norm", ["parallel.pipeline=2", "parallel.pipeline_layout=Et*4|m*3L"], "init_checkpoint"),
    "dp2": ("dense", [], "init_checkpoint"),
    "dp2_distributed_optimizer": ("dense", ["parallel.distributed_optimizer=true"], "init_checkpoint"),
    "ep2": ("moe", ["parallel.expert=2"], "init_checkpoint"),
    "tp2_sp_ep2_etp1": (
        "moe",
        ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2", "parallel.expert_tensor=1",
         TP_CHUNK_TOKENS],
        "init_checkpoint",
    ),
    "tp2_mla": ("mla", ["parallel.tensor=2", TP_CHUNK_TOKENS], "init_checkpoint"),
    "tp2_sp_mla": ("mla", ["parallel.tensor=2", "parallel.sequence_parallel=true", TP_CHUNK_TOKENS], "init_checkpoint"),
    "pp2_qwen_hybrid": ("qwen_hybrid", ["parallel.pipeline=2"], "init_checkpoint"),
    "ep2_qwen_hybrid_moe": ("qwen_hybrid_moe", ["parallel.expert=2"], "init_checkpoint"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``name -> (result, step-0 gradients)`` for every family (single rank) and layout.

    One 2-rank launch (tests/helpers/run_case.py --cases): the references first, each a
    single-process run (the two ranks share them out, each by itself in a process group of its
    own), then all layouts on both ranks. Each case builds its own process groups, model and
    optimizer, so only the start-up of a launch is shared."""
    root = tmp_path_factory.mktemp("layouts")
    refs = [(root / name, BASE + FAMILIES[name], root / f"{name}_init") for name in FAMILIES]
    layouts = [
        (root / name, BASE + FAMILIES[family] + overrides + [f"model.{weights}={root / f'{family}_init'}"], None)
        for name, (family, overrides, weights) in LAYOUTS.items()
    ]
    results = run_cases(refs + layouts, 2, root / "cases", alone=len(refs))
    names = [*FAMILIES, *LAYOUTS]
    cache = {name: (result, load_grads(root / name / "grads0")) for name, result in zip(names, results)}
    return cache.__getitem__


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(runs, layout):
    family = LAYOUTS[layout][0]
    ref, ref_grads = runs(family)
    got, grads = runs(layout)
    ref_h, got_h = ref["history"], got["history"]

    # Step 0: same loss to 1e-5 relative, same MTP gradients (every tensor, full shape).
    assert got_h[0]["loss"] == pytest.approx(ref_h[0]["loss"], rel=1e-5)
    assert set(grads) == set(ref_grads) and ref_grads
    for key, ref_g in ref_grads.items():
        scale = ref_g.abs().max().item()
        assert scale > 0, f"reference gradient of {key} is zero"
        torch.testing.assert_close(grads[key], ref_g, rtol=1e-4, atol=1e-5 * scale, msg=key)
    rope_key = "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight"
    if rope_key in ref_grads:  # MLA: the rope key's rows alone (their gradient is ~1e-3 of the latent rows')
        ref_g, got_g = ref_grads[rope_key][16:], grads[rope_key][16:]
        torch.testing.assert_close(got_g, ref_g, rtol=1e-4, atol=1e-5 * ref_g.abs().max().item(), msg=rope_key)
    # After the optimizer steps (STEPS - 1 of them) the trajectories still agree.
    assert len(got_h) == len(ref_h) == STEPS
    assert got_h[-1]["loss"] == pytest.approx(ref_h[-1]["loss"], rel=1e-4)
    assert got_h[-1]["top1"] == pytest.approx(ref_h[-1]["top1"], abs=1e-6)

    # Frozen backbone: untouched on every rank; optimizer holds exactly the MTP params.
    for result in (ref, got):
        assert result["backbone_identical"]
        assert result["optimizer_updates_exactly_trainable"]
        assert result["optimizer_params_all_mtp"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_trains_only_mtp(runs, family):
    ref, grads = runs(family)
    # Every MTP parameter has a gradient entry and nothing else does.
    assert all(key.startswith("mtp.") for key in grads)
    assert ref["rank0_optimizer_numel"] == ref["rank0_trainable_numel"] == sum(g.numel() for g in grads.values())
    losses = [h["loss"] for h in ref["history"]]
    assert losses[-1] < losses[0]  # it learns
