"""The batched generator over the Megatron model (``bebop_megatron/speculative/batched.py``)
and ``tools/generate_responses.py --megatron``, on a tiny random Llama imported by
tools/convert_from_hf.py's importer (fp32, CPU), against independent references:

- greedy tokens equal transformers' greedy ``generate`` on the same HF model, for a batch of
  prompts of different lengths in which one row stops at an EOS while the others go on;
- every step's logits equal a full no-cache forward of the same tokens (the whole model in
  float64, so that the tolerance is tight);
- sampled records (text, ids, finish reason) equal HFBackend's with the same seeds and the
  same sampler (the logits agree to rounding, fp32);
- a tiny Qwen3-MoE (q/k norms, MoE layers) against its full forward too;
- the tool on an import directory writes the same records as with --hf-dir; models it cannot
  run and bad flags give one error line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bebop_megatron.data.generate import Prompt, plan_jobs
from tests.helpers.data import make_hf_tokenizer, write_jsonl
from tests.helpers.generate_tool import read_out, run_tool
from tests.helpers.single_process import single_process

PROMPTS = [
    {"id": "short", "prompt": "hello"},
    {"id": "long", "messages": [{"role": "system", "content": "tell me a story"},
                                {"role": "user", "content": "once upon a time there was a dog who ran far away"}]},
    {"id": "mid", "prompt": "what is two plus four"},
    {"id": "cat", "prompt": "the cat sat on the mat"},
    {"id": "night", "prompt": "good night"},
]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors, one intra-op thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(hf_dir, imported model, vocab size, eos id)``: a random Llama (GQA, 2 layers) whose
    vocabulary is its word-level tokenizer's (padded to 128 rows in Megatron), with EOS likely
    enough (p ~ 0.1) that samples end both ways; imported in memory in a process group of one,
    left to no other test."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from bebop_megatron.convert.importer import load_hf_model

    path = tmp_path_factory.mktemp("tiny_llama")
    make_hf_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.2,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms away from 1: a misplaced one shows in the logits
                p.add_(0.2 * torch.randn_like(p))
        hidden = model.model(torch.randint(0, len(tok), (16, 20))).last_hidden_state.reshape(-1, 64).mean(0)
        model.lm_head.weight[tok.eos_token_id] = 2.0 * hidden / hidden.norm() ** 2
    model.save_pretrained(path)
    with single_process():
        imported = load_hf_model(str(path), progress=False, log=lambda line: None)
        yield SimpleNamespace(path=path, model=imported.model, vocab=imported.hf.vocab_size, eos=tok.eos_token_id,
                              hf=model)


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompts, max_new_tokens, eos, pad=0) -> list[list[int]]:
    """transformers' greedy ``generate`` with left padding, each row cut after its first EOS."""
    from transformers import GenerationConfig

    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad))[:, P:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


def test_greedy_equals_transformers_generate(tiny):
    from bebop_megatron.speculative.batched import BatchedGenerator

    prompts = random_prompts(tiny.vocab, (5, 13, 2, 8))
    T = 12
    # Pick as EOS the 4th greedy token of row 2 (and not an earlier one of that row), so that
    # row 2 stops early while the others continue; both generators must agree on it.
    free = BatchedGenerator(tiny.model, tiny.vocab, eos_ids=[tiny.eos]).generate(
        prompts, [0] * 4, max_new_tokens=T, temperature=0)
    row = free.tokens[2]
    assert len(row) == T, row
    eos = next(t for i, t in enumerate(row) if i >= 3 and t not in row[:i])
    out = BatchedGenerator(tiny.model, tiny.vocab, eos_ids=[eos]).generate(prompts, [0] * 4, max_new_tokens=T,
                                                                           temperature=0)
    assert out.tokens == hf_greedy(tiny.hf, prompts, T, eos)
    lengths = [len(t) for t in out.tokens]
    assert out.finished_by_eos[2] and lengths[2] < T and max(lengths) == T, lengths


def test_step_logits_equal_a_full_forward(tiny):
    """Sampled rows (the cache sees varied tokens), every step's logits against the model's own
    full-sequence forward of prompt + tokens, one row at a time without padding, in float64."""
    from bebop_megatron.convert.megatron_io import forward_hidden_and_logits
    from bebop_megatron.speculative.batched import BatchedGenerator

    model = tiny.model.double()  # back to float32 below: exact (float32 -> float64 -> float32)
    try:
        prompts = random_prompts(tiny.vocab, (3, 9, 6), seed=1)
        out = BatchedGenerator(model, tiny.vocab, eos_ids=[tiny.eos]).generate(
            prompts, [1, 2, 3], max_new_tokens=10, temperature=1.0, keep_logits=True)
        assert out.logits.dtype == torch.float32  # the sampler's input, as HFBackend's
        worst = 0.0
        for b, prompt in enumerate(prompts):
            seq = prompt + out.tokens[b]
            _, logits = forward_hidden_and_logits(model, torch.tensor([seq]), tiny.vocab)
            ref = logits[0][0, len(prompt) - 1: len(seq) - 1]
            worst = max(worst, (out.logits[b, : len(out.tokens[b])] - ref).abs().max().item())
    finally:
        tiny.model.float()
    assert worst < 1e-5, worst  # float64 model: the float32 cast of the logits is the error


def test_graph_bookkeeping_with_a_stand_in_graph(tiny, monkeypatch):
    """The CUDA-graph path on the CPU: a stand-in ``CUDAGraph`` whose replay re-runs the decode
    step on the static inputs and caches and writes the captured output tensor, as a graph
    would. Same tokens and logits as the eager path, over batches of two shapes (re-captured) and
    of the first shape again. (Whether the capture itself works on CUDA is not tested: no GPU.)"""
    import contextlib

    from bebop_megatron.speculative import batched

    class StandInGraph:
        owner = None

        def replay(self):
            StandInGraph.owner.logits_BV.copy_(StandInGraph.owner.step())

    class NoStream:
        def wait_stream(self, other):
            pass

    captured = []
    real_init = batched._DecodeGraph.__init__

    def init(self, gen, B, L):
        real_init(self, gen, B, L)
        StandInGraph.owner = self
        captured.append((B, L))

    monkeypatch.setattr(torch.cuda, "Stream", NoStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: NoStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(batched._DecodeGraph, "__init__", init)
    eager = batched.BatchedGenerator(tiny.model, tiny.vocab, eos_ids=[tiny.eos])
    graphed = batched.BatchedGenerator(tiny.model, tiny.vocab, eos_ids=[tiny.eos])
    graphed.cuda_graphs = True  # the constructor refuses it off CUDA
    for lengths, seed in [((5, 13, 2), 0), ((60, 3, 9), 1), ((4, 8, 6), 2)]:
        prompts = random_prompts(tiny.vocab, lengths, seed=seed)
        kw = dict(max_new_tokens=10, temperature=1.0, keep_logits=True)
        want = eager.generate(prompts, [7, 8, 9], **kw)
        got = graphed.generate(prompts, [7, 8, 9], **kw)
        assert got.tokens == want.tokens
        assert torch.equal(got.logits, want.logits)
    assert captured == [(3, 64), (3, 128), (3, 64)], captured


def jobs_for(records, n: int, seed: int):
    prompts = [Prompt(r["id"], r.get("messages") or [{"role": "user", "content": r["prompt"]}], {}, i + 1)
               for i, r in enumerate(records)]
    return plan_jobs(prompts, n, seed, set())


def test_samples_equal_hf_backend(tiny):
    from bebop_megatron.data.generate_hf import HFBackend
    from bebop_megatron.speculative.generate_backend import MegatronBackend

    kw = dict(max_new_tokens=12, temperature=0.8, top_p=0.9, batch_size=4, device="cpu", dtype="fp32")
    jobs = jobs_for(PROMPTS, 2, seed=3)  # 10 jobs: batches of 4, 4 and 2
    ours = dict(((j.prompt.key, j.sample), c) for j, c in MegatronBackend(str(tiny.path), **kw).generate(jobs))
    ref = dict(((j.prompt.key, j.sample), c) for j, c in HFBackend(str(tiny.path), **kw).generate(jobs))
    assert ours == ref
    assert {c.finish_reason for c in ours.values()} == {"stop", "length"}  # both kinds covered
    assert all(c.response_ids and c.prompt_ids for c in ours.values())


def test_tool_on_an_import_directory(tiny, tmp_path, capsys):
    """--megatron IMPORT writes the records --hf-dir writes (ids included); the settings name it."""
    from bebop_megatron.convert.importer import convert_from_hf

    meg = tmp_path / "meg"
    convert_from_hf(str(tiny.path), str(meg), max_tensor_parallel=1, progress=False, log=lambda line: None)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    common = ["--prompts", prompts, "--n", 2, "--max-new-tokens", 10, "--temperature", 1.0, "--seed", 4,
              "--device", "cpu", "--threads", 1, "--batch-size", 3, "--no-progress"]
    status, _, err = run_tool(capsys, *common, "--megatron", meg, "--out", tmp_path / "meg.jsonl")
    assert status == 0, err
    assert run_tool(capsys, *common, "--hf-dir", tiny.path, "--out", tmp_path / "hf.jsonl")[0] == 0
    ours, ref = read_out(tmp_path / "meg.jsonl"), read_out(tmp_path / "hf.jsonl")
    assert ours == ref and len(ours) >= 8
    assert all(r["response_ids"] for r in ours.values())
    settings = json.loads((tmp_path / "meg.jsonl.settings.json").read_text())
    assert settings["model"] == f"megatron {os.path.realpath(meg)}"


def test_moe_and_qk_norm_logits_equal_a_full_forward(tiny, tmp_path):
    """A tiny Qwen3-MoE (q/k norms, head dim 16, 4 experts top-2, GQA): every step's logits equal
    the model's full forward of the same tokens (float32; before the tests that import again)."""
    from bebop_megatron.convert.importer import load_hf_model
    from bebop_megatron.convert.megatron_io import forward_hidden_and_logits
    from bebop_megatron.speculative.batched import BatchedGenerator
    from tests.helpers.convert_models import make_hf_model

    imported = load_hf_model(str(make_hf_model("qwen3_moe", tmp_path / "moe")), progress=False, log=lambda line: None)
    model, vocab = imported.model, imported.hf.vocab_size
    assert model.config.num_moe_experts == 4
    prompts = random_prompts(vocab, (4, 10, 7), seed=2)
    out = BatchedGenerator(model, vocab, eos_ids=[3]).generate(prompts, [4, 5, 6], max_new_tokens=8, temperature=1.0,
                                                              keep_logits=True)
    worst = 0.0
    for b, prompt in enumerate(prompts):
        seq = prompt + out.tokens[b]
        _, logits = forward_hidden_and_logits(model, torch.tensor([seq]), vocab)
        ref = logits[0][0, len(prompt) - 1: len(seq) - 1]
        worst = max(worst, (out.logits[b, : len(out.tokens[b])] - ref).abs().max().item())
    assert worst < 1e-4, worst


def test_refusals_and_flag_errors(tiny, tmp_path, capsys):
    from bebop_megatron.speculative.batched import check_supported

    base = dict(multi_latent_attention=False, attention_output_gate=False, experimental_attention_variant=None,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, window_size=None,
                num_moe_experts=None)

    def model_with(**changes):
        return SimpleNamespace(config=SimpleNamespace(**{**base, **changes}), pre_process=True, post_process=True,
                               position_embedding_type="rope")

    def refusal(cuda_graphs=False, **changes) -> str:
        with pytest.raises(ValueError) as err:
            check_supported(model_with(**changes), cuda_graphs)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "multi-latent attention" in refusal(multi_latent_attention=True)
    assert "Gated DeltaNet" in refusal(experimental_attention_variant="gated_delta_net")
    assert "TP=1" in refusal(tensor_model_parallel_size=2)
    assert "sliding-window" in refusal(window_size=(8, 0))
    check_supported(model_with(num_moe_experts=4, moe_expert_capacity_factor=None))  # MoE runs (tested above)
    assert "token dropping" in refusal(num_moe_experts=4, moe_expert_capacity_factor=1.0)
    assert "no CUDA graphs for MoE" in refusal(True, num_moe_experts=4, moe_expert_capacity_factor=None)
    check_supported(tiny.model)  # the real dense model passes

    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    for argv, message in [
        (["--megatron", tiny.path, "--hf-dir", tiny.path], "exactly one backend"),
        (["--megatron", tmp_path / "missing"], "not a directory"),
        (["--megatron", tiny.path, "--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs --megatron and --device cuda"),
        (["--megatron", tmp_path], "neither an import of tools/convert_from_hf.py"),
    ]:
        status, _, err = run_tool(capsys, "--prompts", prompts, "--out", tmp_path / "o.jsonl", *argv)
        assert status == 2 and "Traceback" not in err and message in err, err
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err


def test_study_stages_leave_no_cpu_mode(tiny, tmp_path):
    """The objective study's responses stage writes the same files with either engine; the
    import stage and the megatron engine leave no CPU mode (which would rewrite every CUDA
    device of the later stages to the CPU) and no process group. Last in this file: it ends the
    module's process group."""
    import torch.distributed as dist

    from bebop_megatron.platform import cpu_mode
    from bebop_megatron.study.stages import stage_import, stage_responses

    prompts = jobs_for(PROMPTS, 1, 0)
    sets = {"heldout": [j.prompt for j in prompts[:2]], "train": [j.prompt for j in prompts[2:]]}
    kw = dict(device="cpu", seed=3, max_new_tokens=12, batch_size=2)
    stats = {engine: stage_responses(tiny.path, sets, tmp_path / engine, engine=engine, **kw)
             for engine in ("hf", "megatron")}
    for split in ("heldout", "train"):
        assert (tmp_path / "megatron" / f"{split}.jsonl").read_text() == (tmp_path / "hf" / f"{split}.jsonl").read_text()
        assert stats["megatron"][split]["generated_tokens"] == stats["hf"][split]["generated_tokens"] > 0
    assert not cpu_mode.is_enabled() and not dist.is_initialized()

    stage_import(tiny.path, tmp_path / "work", mtp_num_steps=1)
    assert (tmp_path / "work" / "megatron" / "bebop_model.yaml").is_file()
    assert not cpu_mode.is_enabled() and not dist.is_initialized()
