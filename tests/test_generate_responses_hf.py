"""``tools/generate_responses.py`` with local HF weights (``--hf-dir``), on a tiny random Qwen2:
the samples equal a plain one-row, no-cache sampling loop with the same per-sample
generators (so they do not depend on the batch), across batch sizes and a resume;
``--max-new-tokens`` / ``finish_reason``; ``--n``; greedy; the output loads with the
project's JSONL reader; ``sample_tokens`` against a plain reference. (The endpoint backend
and the CLI errors: tests/test_generate_responses.py.)
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from bebop_megatron.data.generate import sample_seed
from bebop_megatron.data.jsonl import read_jsonl
from bebop_megatron.data.tokenizer import HFTokenizer
from tests.helpers.data import CHAT_TEMPLATE, ROLE_TOKENS, WORDS, write_jsonl
from tests.helpers.generate_tool import interrupted_copy, read_out, run_tool


def make_byte_bpe_tokenizer(path: Path) -> None:
    """A tiny byte-level BPE tokenizer (320 tokens) with the test chat template. Byte-level BPE,
    not the word-level tokenizer of tests/helpers/data.py: transformers 5 loads a directory whose
    config.json says qwen2 with Qwen2Tokenizer, which only keeps a BPE's vocabulary and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", *ROLE_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                 additional_special_tokens=ROLE_TOKENS)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(path))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (hidden 32, 2 layers) with a byte-level BPE tokenizer and a chat template."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_byte_bpe_tokenizer(path)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3)  # peakier distributions than the default 0.02
    config.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)  # as the tool will load it (it may add a token)
    config.vocab_size = len(tok)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # EOS's logit about 3 on typical hidden states (p ~ 0.1): "stop" and "length"
        hidden = model.model(torch.randint(0, len(tok), (16, 20))).last_hidden_state.reshape(-1, 32).mean(0)
        model.lm_head.weight[tok.eos_token_id] = 3.0 * hidden / hidden.norm() ** 2
    model.save_pretrained(path)
    return path


HF_PROMPTS = [
    {"id": "short", "prompt": "hello"},
    {"id": "long", "messages": [{"role": "system", "content": "tell me a story"},
                                {"role": "user", "content": "once upon a time there was a dog who ran far away"}]},
    {"id": "mid", "prompt": "what is two plus four", "source": "math"},
]


@torch.inference_mode()
def reference_sample(model, tok, messages, seed, temperature, top_p, max_new_tokens, eos_id, ids_too=False):
    """One sample by a plain loop: batch of one, no padding, no KV cache, float64 sampling:
    ``(text, finish_reason, num_tokens)`` (``+ (prompt ids, sampled ids)`` with ``ids_too``)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    gen, new = torch.Generator().manual_seed(seed), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids + new])).logits[0, -1].double()
        u = torch.rand(1, generator=gen, dtype=torch.float64).item()
        p = torch.softmax(logits / temperature, dim=-1).tolist()
        by_mass = sorted(range(len(p)), key=lambda i: -p[i])
        before, keep = 0.0, set()
        for i in by_mass:
            if before < top_p:
                keep.add(i)
            before += p[i]
        kept = [p[i] if i in keep else 0.0 for i in range(len(p))]
        target, cum = u * sum(kept), 0.0
        token = next(i for i in range(len(p)) if (cum := cum + kept[i]) > target)
        new.append(token)
        if token == eos_id:
            return (tok.decode(new[:-1], skip_special_tokens=True), "stop", len(new)) + ((ids, new) if ids_too else ())
    return (tok.decode(new, skip_special_tokens=True), "length", len(new)) + ((ids, new) if ids_too else ())


def test_hf_samples_match_plain_loop_across_batch_sizes_and_resume(tmp_path, capsys, hf_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = write_jsonl(tmp_path / "p.jsonl", HF_PROMPTS)
    common = ["--prompts", prompts, "--hf-dir", hf_model, "--n", 3, "--max-new-tokens", 12, "--temperature", 0.8,
              "--top-p", 0.9, "--seed", 5, "--device", "cpu", "--threads", 1]
    runs = {}
    for batch_size in (4, 1):
        runs[batch_size] = tmp_path / f"b{batch_size}.jsonl"
        assert run_tool(capsys, *common, "--batch-size", batch_size, "--out", runs[batch_size])[0] == 0
    records = read_out(runs[4])
    assert records == read_out(runs[1])
    assert json.loads(runs[4].with_name("b4.jsonl.settings.json").read_text())["model"] == \
        f"hf-dir {os.path.realpath(hf_model)}"
    assert {r["finish_reason"] for r in records.values()} == {"stop", "length"}  # both kinds covered

    model = AutoModelForCausalLM.from_pretrained(hf_model).eval()
    tok = AutoTokenizer.from_pretrained(hf_model)
    for prompt in HF_PROMPTS:
        key = json.dumps(prompt["id"])
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        for j in range(3):
            text, reason, num, prompt_ids, sampled = reference_sample(model, tok, messages, sample_seed(5, key, j), 0.8,
                                                                      0.9, 12, tok.eos_token_id, ids_too=True)
            if not text.strip():  # an empty response is not written
                assert (key, j) not in records
                continue
            rec = records[(key, j)]
            assert rec["messages"] == messages + [{"role": "assistant", "content": text}], (key, j)
            assert (rec["finish_reason"], rec["num_tokens"]) == (reason, num), (key, j)
            # The sampled ids, exactly (the EOS included when it stopped), next to the text.
            assert (rec["prompt_ids"], rec["response_ids"]) == (prompt_ids, sampled), (key, j)
    assert records[('"mid"', 0)]["source"] == "math"

    # Resume with another batch size: only the missing samples, the same texts.
    resumed = tmp_path / "resumed.jsonl"
    interrupted_copy(runs[4], resumed, 4, 10)
    status, _, stderr = run_tool(capsys, *common, "--batch-size", 2, "--out", resumed)
    assert status == 0 and "5 to generate, 4 already in" in stderr
    assert read_out(resumed) == records

    # Another seed: other samples.
    other = tmp_path / "seed6.jsonl"
    assert run_tool(capsys, *[a if a != 5 else 6 for a in common], "--out", other)[0] == 0
    assert read_out(other) != records


def test_hf_length_n_greedy_and_jsonl_reader(tmp_path, capsys, hf_model):
    prompts = write_jsonl(tmp_path / "p.jsonl", HF_PROMPTS)
    out = tmp_path / "out.jsonl"
    status, stdout, _ = run_tool(capsys, "--prompts", prompts, "--out", out, "--hf-dir", hf_model, "--n", 4,
                                 "--max-new-tokens", 3, "--batch-size", 5, "--device", "cpu", "--threads", 1)
    assert status == 0
    records = read_out(out)
    num_empty = 12 - len(records)  # a response that is only the end of turn is not written
    assert (f"({num_empty} empty responses dropped)" in stdout) if num_empty else ("dropped" not in stdout)
    assert all(count <= 4 for count in Counter(key for key, _ in records).values())
    for rec in records.values():  # "length": exactly --max-new-tokens; "stop": the EOS within them
        assert rec["num_tokens"] == 3 if rec["finish_reason"] == "length" else 1 <= rec["num_tokens"] <= 3
    assert any(r["finish_reason"] == "length" for r in records.values())

    # The project's JSONL reader takes the file and trains on the sampled ids (no re-tokenization).
    tokenizer = HFTokenizer(str(hf_model))
    docs = read_jsonl(str(out), tokenizer, progress=False, log=lambda _: None)
    assert len(docs) == len(records)
    for j, rec in enumerate(records.values()):
        tokens, trained = docs.get(j)
        assert tokens.tolist() == rec["prompt_ids"] + rec["response_ids"]
        assert trained.tolist() == [0] * len(rec["prompt_ids"]) + [1] * len(rec["response_ids"])
        assert len(rec["response_ids"]) == rec["num_tokens"]
        assert rec["messages"][-1]["content"] in tokenizer.decode(tokens[trained.astype(bool)])

    # Greedy: the n samples of a prompt are identical, so --dedupe-responses keeps one.
    greedy = tmp_path / "greedy.jsonl"
    status, stdout, _ = run_tool(capsys, "--prompts", prompts, "--out", greedy, "--hf-dir", hf_model, "--n", 3,
                                 "--temperature", 0, "--max-new-tokens", 6, "--dedupe-responses", "--device", "cpu")
    written = read_out(greedy)
    assert status == 0 and written and all(j == 0 for _, j in written)
    assert f"({2 * len(written)} duplicate responses" in stdout  # the other prompts' answer is empty


def test_sample_tokens_against_reference():
    from bebop_megatron.data.generate_hf import sample_tokens

    torch.manual_seed(0)
    V, M = 37, 4001
    logits = torch.randn(V) * 2
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.8), (1.3, 0.3)):
        p = torch.softmax(logits.double() / temperature, dim=-1)
        order = torch.argsort(p, descending=True, stable=True)
        keep = torch.zeros(V, dtype=torch.bool)
        keep[order] = (p[order].cumsum(0) - p[order]) < top_p
        expected = torch.where(keep, p, 0.0) / p[keep].sum()
        uniforms = (torch.arange(M, dtype=torch.float64) + 0.5) / M  # a grid: frequencies are exact to 1/M
        tokens = sample_tokens(logits.expand(M, V), uniforms, temperature, top_p)
        freq = torch.bincount(tokens, minlength=V).double() / M
        assert (freq - expected).abs().max() <= 1.0 / M + 1e-12, (temperature, top_p)
        assert not freq[~keep].any()
    assert sample_tokens(logits[None], torch.tensor([0.5]), 0.0, 1.0).item() == logits.argmax().item()
