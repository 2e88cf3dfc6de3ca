"""Context parallelism (``parallel.context=2``, SDPA backend, 2 gloo ranks) against one rank.

Each row is split into 4 chunks of 8 positions (rank 0: chunks 0 and 3, rank 1: chunks 1 and 2);
with K = 3 MTP steps every chunk's last 3 positions have chains whose targets (backbone hidden
states at t+k, shifted labels, the MTP block's shifted input tokens) lie in the next chunk, on
the other rank or (rank 1) in its own other chunk, so a wrong boundary hand-over changes the
loss and the gradients (replacing the gathered backbone rows of the next chunk by zeros fails
every case below). The attention of the C=2 runs is model/cp_attention.py (gathered K/V, block
kernels merged by log-sum-exp), that of the references the plain fused SDPA.

Cases (GQA: 4 query heads, 2 groups): synthetic causal rows with e2e TV; packed rows of a JSONL
corpus (documents of 8-30 tokens that span chunks and ranks) with CE, and with e2e NLA and the
``pre_norm`` hand-off. Checked against the single-rank run from the same initial weights: the
loss and the logged gradient norm of every step (relative 1e-5 and 1e-4; 2 Adam updates in
between), the MTP gradients of step 0, and the alpha / E[L] statistics of every step.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.data import write_jsonl
from tests.helpers.launch import load_grads, run_cases

STEPS = 3
BASE = [
    "device=cpu", f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.seq_length=32", "train.lr=3e-3", "train.warmup_fraction=0.0",
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=200",
    "mtp.num_layers=1", "mtp.num_steps=3", "loss.chunk_tokens=37", "parallel.tensor=1",
]
WORDS = "the cat sat on a mat and then it ran to the big red barn where a cow was eating hay".split()


def _corpus(path):
    rng = random.Random(0)
    words = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    return write_jsonl(path, [{"prompt": words(2, 6), "response": words(4, 18)} for _ in range(80)])


def _cases(corpus):
    packed = [f"data.train_files=[{corpus}]", "model.vocab_size=512"]
    return {
        "causal_e2e_tv": ["loss.type=e2e_tv"],
        "packed_ce": [*packed, "loss.type=ce"],
        "packed_e2e_nla_pre_norm": [*packed, "loss.type=e2e_nla", "mtp.next_step_input=pre_norm"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    cases = _cases(_corpus(root / "train.jsonl"))
    refs = [(root / f"{name}_c1", BASE + extra, root / f"{name}_init") for name, extra in cases.items()]
    cps = [(root / f"{name}_c2", BASE + extra + ["parallel.context=2", f"model.init_checkpoint={root / f'{name}_init'}"],
            None) for name, extra in cases.items()]
    results = run_cases(refs + cps, 2, root / "cases", alone=len(refs))
    out = {}
    for i, name in enumerate(cases):
        out[name] = [(results[j], load_grads(path / "grads0"))
                     for j, (path, _, _) in ((i, refs[i]), (len(refs) + i, cps[i]))]
    return out


@pytest.mark.parametrize("case", ["causal_e2e_tv", "packed_ce", "packed_e2e_nla_pre_norm"])
def test_context_parallel_matches_one_rank(runs, case):
    (ref, ref_grads), (got, grads) = runs[case]
    assert_matches_one_rank(ref, ref_grads, got, grads)


def assert_matches_one_rank(ref, ref_grads, got, grads):
    """The losses, grad norms and statistics of every step and the MTP gradients of step 0 of a
    parallel run equal the single-rank run's."""
    ref_h, got_h = ref["history"], got["history"]
    assert len(ref_h) == len(got_h) == STEPS
    for step, (r, g) in enumerate(zip(ref_h, got_h)):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), f"step {step}"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), f"step {step} grad_norm"
        for key in ("alpha_rs", "alpha_to", "accept_len_rs", "top1", "ce"):
            assert g[key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), f"step {step} {key}"
    assert ref_h[-1]["loss"] < ref_h[0]["loss"]  # it trains
    assert set(grads) == set(ref_grads) and ref_grads
    for key, ref_g in ref_grads.items():
        scale = ref_g.abs().max().item()
        assert scale > 0, f"reference gradient of {key} is zero"
        torch.testing.assert_close(grads[key], ref_g, rtol=1e-4, atol=1e-5 * scale, msg=key)
    assert got["backbone_identical"] and got["optimizer_updates_exactly_trainable"]


# ----------------------------------------------------------------------------- with TP + SP, DP, PP, EP (4 ranks)

MOE = ["model.family=moe", "model.num_experts=4", "model.moe_router_topk=2", "model.ffn_hidden_size=64",
       "model.moe_shared_expert_intermediate_size=64", "model.moe_aux_loss_coeff=0.1"]
# name -> (reference, overrides of the 4-rank run, the layout Megatron-Core builds from them)
LAYOUTS_4 = {
    "tp2_sp_cp2": ("causal_e2e_tv", ["parallel.tensor=2", "parallel.sequence_parallel=true"],
                   dict(tensor=2, context=2, data=1, pipeline=1, expert=1, sequence_parallel=True)),
    "tp2_sp_cp2_packed_ce": ("packed_ce", ["parallel.tensor=2", "parallel.sequence_parallel=true"],
                             dict(tensor=2, context=2, data=1, pipeline=1, expert=1, sequence_parallel=True)),
    "dp2_cp2_distributed_optimizer": ("causal_e2e_tv", ["parallel.distributed_optimizer=true"],
                                      dict(tensor=1, context=2, data=2, pipeline=1, expert=1,
                                           sequence_parallel=False)),
    "pp2_cp2": ("causal_e2e_tv", ["parallel.pipeline=2"],
                dict(tensor=1, context=2, data=1, pipeline=2, expert=1, sequence_parallel=False)),
    "ep2_cp2_moe": ("moe_e2e_tv", ["parallel.expert=2"],
                    dict(tensor=1, context=2, data=2, pipeline=1, expert=2, sequence_parallel=False)),
}


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    """One 4-rank launch: the single-rank references (shared out over the ranks), then every
    layout of :data:`LAYOUTS_4` at ``parallel.context=2`` from the reference's initial weights."""
    root = tmp_path_factory.mktemp("cp4")
    cases = _cases(_corpus(root / "train.jsonl"))
    refs = {name: cases[name] for name in ("causal_e2e_tv", "packed_ce")}
    refs["moe_e2e_tv"] = [*MOE, "loss.type=e2e_tv"]
    ref_runs = [(root / name, BASE + extra, root / f"{name}_init") for name, extra in refs.items()]
    runs = [(root / name, BASE + refs[ref] + overrides + ["parallel.context=2",
                                                          f"model.init_checkpoint={root / f'{ref}_init'}"], None)
            for name, (ref, overrides, _) in LAYOUTS_4.items()]
    results = run_cases(ref_runs + runs, 4, root / "cases", alone=len(ref_runs))
    return {path.name: (result, load_grads(path / "grads0"))
            for (path, _, _), result in zip(ref_runs + runs, results)}


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_context_parallel_with_other_parallelisms_matches_one_rank(runs_4, layout):
    """C=2 with TP=2 + SP, with DP=2 (the distributed optimizer: gradients reduce-scattered over
    DP x CP), with PP=2 (the stages send this CP rank's chunks) and with EP=2 (a MoE MTP layer with
    the router's auxiliary loss; DP=2 too), on 4 ranks against the single-rank run on the same
    rows (the same global batch)."""
    ref_name, _, sizes = LAYOUTS_4[layout]
    (ref, ref_grads), (got, grads) = runs_4[ref_name], runs_4[layout]
    assert got["layout"] == sizes and got["world_size"] == 4
    assert f"TP={sizes['tensor']} CP=2 PP={sizes['pipeline']} EP={sizes['expert']}" in got["summary"]
    assert_matches_one_rank(ref, ref_grads, got, grads)


# ----------------------------------------------------------------------------- MLA, Gated DeltaNet, held-out pass
# One more 2-rank launch, C=2 against C=1 on the same rows and weights, compared as
# test_context_parallel_matches_one_rank: Multi-Latent Attention (DeepSeek-style, MoE; value heads
# narrower than the query/key heads, whose rotary part is sharded with the rows' 2C chunks) on packed
# rows with CE, whose run also compares the trainer's held-out pass after its 3 steps (data.valid_files:
# the loss, the statistics and the decode-exact forecast, whose recursion runs along whole rows); and
# a Qwen3-Next-style hybrid (Gated DeltaNet layers: recurrent along the whole row) on causal and packed rows.

QWEN_HYBRID = ["model.layer_types=[linear_attention,full_attention]", "model.attention_output_gate=true",
               "model.zero_centered_norms=true", "model.kv_channels=16", "model.rotary_percent=0.25",
               "model.linear_key_head_dim=8", "model.linear_value_head_dim=8", "model.linear_num_key_heads=2",
               "model.linear_num_value_heads=4", "model.qk_layernorm=true"]
MLA = ["model.family=moe", "model.num_experts=4", "model.num_query_groups=4", "model.multi_latent_attention=true",
       "model.kv_lora_rank=16", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=8",
       "model.q_lora_rank=32", "model.moe_first_dense_layers=1"]


def _more_cases(corpus):
    packed = [f"data.train_files=[{corpus}]", "model.vocab_size=512"]
    return {"packed_mla_ce_valid": [*packed, *MLA, "loss.type=ce", f"data.valid_files=[{corpus}]",
                                    "eval.max_samples=6"],
            "packed_qwen_hybrid": [*packed, *QWEN_HYBRID, "loss.type=e2e_tv"],
            "causal_qwen_hybrid": [*QWEN_HYBRID, "loss.type=e2e_tv"]}


@pytest.fixture(scope="module")
def more_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_more")
    cases = _more_cases(_corpus(root / "train.jsonl"))
    refs = [(root / f"{name}_c1", BASE + extra, root / f"{name}_init") for name, extra in cases.items()]
    cps = [(root / f"{name}_c2", BASE + extra + ["parallel.context=2",
                                                 f"model.init_checkpoint={root / f'{name}_init'}"], None)
           for name, extra in cases.items()]
    results = run_cases(refs + cps, 2, root / "cases", alone=len(refs))
    return {name: [(results[j], load_grads(path / "grads0"))
                   for j, (path, _, _) in ((i, refs[i]), (len(refs) + i, cps[i]))]
            for i, name in enumerate(cases)}


@pytest.mark.parametrize("case", ["packed_mla_ce_valid", "packed_qwen_hybrid", "causal_qwen_hybrid"])
def test_context_parallel_mla_and_gated_deltanet_match_one_rank(more_runs, case):
    test_context_parallel_matches_one_rank(more_runs, case)


def test_context_parallel_held_out_pass_matches_one_rank(more_runs):
    (ref, _), (got, _) = more_runs["packed_mla_ce_valid"]
    ref_v, got_v = ref["valid"], got["valid"]
    assert len(ref_v["accept_len_decode_rs"]) == len(ref_v["accept_len_decode_to"]) == 3  # gamma = 1..K
    for key, value in ref_v.items():
        assert got_v[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert ref_v["accept_len_decode_rs"] != ref_v["accept_len_rs"]  # the forecast is its own number
