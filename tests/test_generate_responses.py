"""``tools/generate_responses.py``: on-policy responses from an endpoint or local HF weights.

- endpoint backend against a loopback OpenAI-compatible server (``FakeServer``): normal
  answers, retried timeouts / 5xx / 429, a permanent 500, malformed JSON and a 400 (one
  ``error:`` line each, the others written, exit status 1), concurrency, resume from a
  partial file with a truncated last line (only the missing samples are requested),
  duplicate prompts and ``--dedupe-responses``;
- HF backend on a tiny random Qwen2: the samples equal a plain one-row, no-cache sampling
  loop with the same per-sample generators (so they do not depend on the batch), across
  batch sizes and a resume; ``--max-new-tokens`` / ``finish_reason``; ``--n``; greedy; the
  output loads with the project's JSONL reader; ``sample_tokens`` against a plain reference;
- CLI errors: one ``error:`` line and exit status 2.

The tool runs in-process (``run_cli`` around its ``main``, as its ``__main__`` does) to keep
the file fast; one test runs it as a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from bebop_megatron.cli import run_cli
from bebop_megatron.data.generate import (Completion, ExistingOutput, plan_jobs, read_prompts, run_generation,
                                           sample_seed)
from bebop_megatron.data.jsonl import read_jsonl
from bebop_megatron.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.helpers.data import CHAT_TEMPLATE, ROLE_TOKENS, WORDS, write_jsonl
from tests.helpers.launch import REPO

TOOL_PATH = REPO / "tools" / "generate_responses.py"
_spec = importlib.util.spec_from_file_location("generate_responses_tool", TOOL_PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def run_tool(capsys, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one in-process run."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: sys.exit(tool.main([str(a) for a in args])))
    out = capsys.readouterr()
    return exit_info.value.code or 0, out.out, out.err


def read_out(path: Path) -> dict:
    """(id, sample) -> output record; asserts every line is complete and no key repeats."""
    data = path.read_bytes()
    assert data.endswith(b"\n")
    records = [json.loads(line) for line in data.splitlines()]
    keyed = {(json.dumps(r["id"]), r["sample"]): r for r in records}
    assert len(keyed) == len(records), "a sample was written twice"
    return keyed


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ----------------------------------------------------------------------------- endpoint


class FakeServer:
    """A loopback OpenAI-compatible server whose behaviour is chosen by the user's message:

    ``slow-once`` answers its first request after 5 s (beyond the client's --timeout),
    ``flaky`` and ``busy`` answer 500 / 429 once, ``down`` always 500, ``garbage`` is not
    JSON, ``bad-request`` is a 400, ``same`` always answers the same text, ``surrogate`` a
    lone UTF-16 surrogate (valid JSON, not valid Unicode); anything else
    answers ``"<message> reply <seed mod 1000>"`` (``finish_reason`` length when
    ``max_tokens < 4``). Each chat request is recorded as (message, seed).
    """

    def __init__(self, delay: float = 0.0):
        self.requests: list[tuple[str, int]] = []
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.delay = delay
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                if self.path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": "tiny-served", "object": "model"}]})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions":
                    return self.reply(404, {"error": "not found"})
                server.handle_chat(self, body)

            def reply(self, code, obj=None, raw=None):
                data = raw if raw is not None else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # the client gave up on a slow answer
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def handle_chat(self, handler, body: dict) -> None:
        message, seed = body["messages"][-1]["content"], body["seed"]
        with self.lock:
            self.requests.append((message, seed))
            self.bodies.append(body)
            attempt = sum(1 for m, _ in self.requests if m == message)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            if message == "slow-once" and attempt == 1:
                time.sleep(5.0)
            if (message == "flaky" and attempt == 1) or message == "down":
                return handler.reply(500, {"error": "internal server error"})
            if message == "busy" and attempt == 1:
                return handler.reply(429, {"error": "too many requests"})
            if message == "bad-request":
                return handler.reply(400, {"error": "prompt is too long"})
            if message == "garbage":
                return handler.reply(200, raw=b"<html>proxy error</html>")
            text = {"same": "same answer", "surrogate": "half a pair \ud800"}.get(message,
                                                                                  f"{message} reply {seed % 1000}")
            reason = "length" if body["max_tokens"] < 4 else "stop"
            handler.reply(200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                             "finish_reason": reason}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": len(text.split()),
                                          "total_tokens": 3 + len(text.split())}})
        finally:
            with self.lock:
                self.in_flight -= 1

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    srv = FakeServer()
    yield srv
    srv.close()


# Generous timeouts for a loaded CI machine; only ``slow-once`` (5 s) goes beyond its 2 s.
FAST = ["--timeout", "5", "--retries", "2", "--backoff", "0.01"]


def test_endpoint_answers(tmp_path, capsys, server):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "hello", "source": "s1"},
        {"id": 7, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]},
        {"prompt": "no id"},
    ])
    out = tmp_path / "out.jsonl"
    status, stdout, _ = run_tool(capsys, "--prompts", prompts, "--out", out, "--endpoint", server.url + "/v1/",
                                 "--n", 2, "--temperature", 0.7, "--top-p", 0.9, "--max-new-tokens", 50,
                                 "--seed", 3, "--concurrency", 3, *FAST)
    assert status == 0
    assert "done: 6 samples written" in stdout and "0 failed" in stdout
    records = read_out(out)
    assert len(records) == 6 and len(server.requests) == 6
    rec = records[('"a"', 1)]
    seed = sample_seed(3, '"a"', 1) & 0x7FFFFFFF
    assert rec["messages"] == [{"role": "user", "content": "hello"},
                               {"role": "assistant", "content": f"hello reply {seed % 1000}"}]
    assert (rec["finish_reason"], rec["num_tokens"], rec["source"]) == ("stop", 3, "s1")
    assert records[("7", 0)]["messages"][0] == {"role": "system", "content": "be brief"}
    no_id = [r for r in records.values() if r["messages"][0]["content"] == "no id"]
    assert len(no_id) == 2 and isinstance(no_id[0]["id"], str) and len(no_id[0]["id"]) == 16
    body = server.bodies[0]
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"], body["n"]) == \
        ("tiny-served", 0.7, 0.9, 50, 1)
    # It trains as is: the project's JSONL reader takes every line.
    assert len(read_jsonl(str(out), ByteTokenizer(), progress=False, log=lambda _: None)) == 6


def test_endpoint_failures_and_retries(tmp_path, capsys, server):
    messages = ["slow-once", "flaky", "busy", "down", "garbage", "bad-request", "surrogate", "fine"]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": m, "prompt": m} for m in messages])
    out = tmp_path / "out.jsonl"
    status, stdout, stderr = run_tool(capsys, "--prompts", prompts, "--out", out, "--endpoint", server.url,
                                      "--model", "m", "--concurrency", 4, *FAST, "--timeout", 2)
    assert status == 1, stderr
    assert {key[0] for key in read_out(out)} == {'"slow-once"', '"flaky"', '"busy"', '"fine"'}, stderr
    attempts = Counter(m for m, _ in server.requests)
    assert attempts == {"slow-once": 2, "flaky": 2, "busy": 2, "down": 3, "garbage": 1, "bad-request": 1,
                        "surrogate": 1, "fine": 1}
    errors = error_lines(stderr)
    assert len(errors) == 4, stderr
    failed = ("down", "garbage", "bad-request", "surrogate")
    by_prompt = {next(m for m in failed if f'"{m}"' in e): e for e in errors}
    assert "HTTP 500" in by_prompt["down"] and "after 3 attempts" in by_prompt["down"]
    assert "not JSON" in by_prompt["garbage"] and "proxy error" in by_prompt["garbage"]
    assert "HTTP 400" in by_prompt["bad-request"] and "not retried" in by_prompt["bad-request"]
    assert "not valid Unicode" in by_prompt["surrogate"]
    assert "4 failed" in stdout
    assert "Traceback" not in stderr


def test_endpoint_concurrency_keeps_every_result(tmp_path, capsys):
    srv = FakeServer(delay=0.02)
    try:
        prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": f"q{i}"} for i in range(30)])
        out = tmp_path / "out.jsonl"
        status, _, _ = run_tool(capsys, "--prompts", prompts, "--out", out, "--endpoint", srv.url, "--n", 2,
                                "--concurrency", 8, *FAST)
    finally:
        srv.close()
    assert status == 0 and srv.max_in_flight > 1
    records = read_out(out)
    assert set(records) == {(str(i), j) for i in range(30) for j in range(2)}
    for (key, j), rec in records.items():  # each answer is filed under its own prompt and sample
        seed = sample_seed(0, key, j) & 0x7FFFFFFF
        assert rec["messages"][-1]["content"] == f"q{key} reply {seed % 1000}"


def test_endpoint_resume(tmp_path, capsys, server):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(4)])
    full, partial = tmp_path / "full.jsonl", tmp_path / "partial.jsonl"
    args = ["--prompts", prompts, "--endpoint", server.url, "--n", 3, "--concurrency", 2, *FAST]
    assert run_tool(capsys, *args, "--out", full)[0] == 0
    lines = full.read_bytes().splitlines(keepends=True)
    partial.write_bytes(b"".join(lines[:5]) + lines[5][:20])  # an interrupted write
    server.requests.clear()
    status, _, stderr = run_tool(capsys, *args, "--out", partial)
    assert status == 0
    assert "7 to generate, 5 already in" in stderr and "truncated last line" in stderr
    missing = set(read_out(full)) - {(json.dumps(r["id"]), r["sample"]) for r in map(json.loads, lines[:5])}
    assert sorted(server.requests) == sorted((f"question {json.loads(key)[1:]}", sample_seed(0, key, j) & 0x7FFFFFFF)
                                             for key, j in missing)
    assert read_out(partial) == read_out(full)  # same seeds: the same answers


def test_duplicate_prompts_and_responses(tmp_path, capsys, server):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "same"},
        {"id": "b", "messages": [{"role": "user", "content": "same"}]},  # the same prompt: dropped
        {"id": "c", "prompt": "other"},
        "",
    ])
    out = tmp_path / "out.jsonl"
    status, stdout, stderr = run_tool(capsys, "--prompts", prompts, "--out", out, "--endpoint", server.url,
                                      "--n", 3, "--dedupe-responses", *FAST)
    assert status == 0
    assert "2 prompts (1 duplicate prompts dropped)" in stderr
    assert len(server.requests) == 6
    kept = Counter(key for key, _ in read_out(out))  # which "a" sample is kept: the first to finish
    assert kept == {'"a"': 1, '"c"': 3}
    assert "2 duplicate responses dropped" in stdout
    # A rerun asks again for the dropped samples and compares them with the responses on file.
    before = out.read_bytes()
    status, stdout, _ = run_tool(capsys, "--prompts", prompts, "--out", out, "--endpoint", server.url,
                                 "--n", 3, "--dedupe-responses", *FAST)
    assert status == 0 and "2 duplicate responses dropped" in stdout and out.read_bytes() == before
    # --limit: the first N distinct prompts.
    out2 = tmp_path / "out2.jsonl"
    assert run_tool(capsys, "--prompts", prompts, "--out", out2, "--endpoint", server.url, "--limit", 1, *FAST)[0] == 0
    assert list(read_out(out2)) == [('"a"', 0)]


def test_ctrl_c_keeps_finished_samples(tmp_path, capsys):
    """Ctrl-C mid-run: the samples already finished are on disk, one line says so, status 130."""
    class InterruptedBackend:
        def generate(self, jobs):
            for job in jobs[:2]:
                yield job, Completion(f"answer {job.sample}", "stop", 2)
            raise KeyboardInterrupt

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    jobs = plan_jobs(read_prompts(str(prompts)).prompts, 4, 0, set())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: run_generation(InterruptedBackend(), jobs, str(out), ExistingOutput()))
    assert exit_info.value.code == 130
    assert "interrupted: 2 samples written" in capsys.readouterr().err
    assert sorted(read_out(out)) == [('"a"', 0), ('"a"', 1)]


# ----------------------------------------------------------------------------- HF


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
def reference_sample(model, tok, messages, seed, temperature, top_p, max_new_tokens, eos_id) -> tuple[str, str, int]:
    """One sample by a plain loop: batch of one, no padding, no KV cache, float64 sampling."""
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
            return tok.decode(new[:-1], skip_special_tokens=True), "stop", len(new)
    return tok.decode(new, skip_special_tokens=True), "length", len(new)


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
    assert {r["finish_reason"] for r in records.values()} == {"stop", "length"}  # both kinds covered

    model = AutoModelForCausalLM.from_pretrained(hf_model).eval()
    tok = AutoTokenizer.from_pretrained(hf_model)
    for prompt in HF_PROMPTS:
        key = json.dumps(prompt["id"])
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        for j in range(3):
            text, reason, num = reference_sample(model, tok, messages, sample_seed(5, key, j), 0.8, 0.9, 12,
                                                 tok.eos_token_id)
            if not text.strip():  # an empty response is not written
                assert (key, j) not in records
                continue
            rec = records[(key, j)]
            assert rec["messages"] == messages + [{"role": "assistant", "content": text}], (key, j)
            assert (rec["finish_reason"], rec["num_tokens"]) == (reason, num), (key, j)
    assert records[('"mid"', 0)]["source"] == "math"

    # Resume with another batch size: only the missing samples, the same texts.
    lines = runs[4].read_bytes().splitlines(keepends=True)
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_bytes(b"".join(lines[:4]) + lines[4][:10])
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

    # The project's JSONL reader takes the file and trains on the responses.
    tokenizer = HFTokenizer(str(hf_model))
    docs = read_jsonl(str(out), tokenizer, progress=False, log=lambda _: None)
    assert len(docs) == len(records)
    for j, rec in enumerate(records.values()):
        tokens, trained = docs.get(j)
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


# ----------------------------------------------------------------------------- CLI errors


@pytest.mark.parametrize("line, message", [
    ("{not json", "malformed JSON"),
    ('{"prompt": "hi",', "malformed JSON: Expecting property name enclosed in double quotes at column 17 (the end of "
                        "the line)"),  # not the decoder's "line 2 column 1"
    ('["a"]', "expected a JSON object, got array"),
    ('{"id": "x"}', "needs exactly one of 'prompt'"),
    ('{"prompt": "a", "messages": []}', "got both"),
    ('{"messages": [{"role": "user"}]}', "messages[0].content must be a string, got null"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}', "nothing to respond"),
    ('{"prompt": "a", "sample": 0}', "'sample' is reserved"),
    ('{"id": "first", "prompt": "other"}', "duplicate id \"first\" (line 1"),
    ('{"id": true, "prompt": "x"}', "field 'id' must be"),
])
def test_malformed_prompt_line(tmp_path, capsys, line, message):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "first", "prompt": "hi"}, line])
    status, _, stderr = run_tool(capsys, "--prompts", prompts, "--out", tmp_path / "o.jsonl",
                                 "--endpoint", "http://127.0.0.1:9")
    assert status == 2
    assert stderr.strip().splitlines()[-1:] == error_lines(stderr)
    assert error_lines(stderr)[0].startswith(f"error: {prompts}:2: ") and message in stderr, stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_errors(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    out = tmp_path / "o.jsonl"
    cases = [
        (["--prompts", tmp_path / "missing.jsonl", "--endpoint", "http://x"], "missing.jsonl: file not found"),
        (["--prompts", prompts, "--endpoint", "http://x", "--hf-dir", tmp_path], "exactly one backend"),
        (["--prompts", prompts], "exactly one backend"),
        (["--prompts", prompts, "--hf-dir", tmp_path / "nope"], "not a directory"),
        (["--prompts", prompts, "--endpoint", "http://x", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompts", prompts, "--endpoint", "localhost:8000"], "expected an http:// or https:// URL"),
        (["--prompts", prompts, "--endpoint", "http://127.0.0.1:9", "--retries", "0"], "cannot list the served models"),
    ]
    for args, message in cases:
        status, _, stderr = run_tool(capsys, *args, "--out", out)
        assert status == 2, (args, stderr)
        assert len(error_lines(stderr)) == 1 and message in error_lines(stderr)[0], (args, stderr)
        assert "Traceback" not in stderr


def test_cli_subprocess_malformed_line(tmp_path):
    """The real entry point: one error line naming PATH:LINE, status 2, no traceback."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, '{"prompt": 3}'])
    proc = subprocess.run([sys.executable, str(TOOL_PATH), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                           "--endpoint", "http://127.0.0.1:9"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {prompts}:2: field 'prompt' must be a non-empty string, got number"
