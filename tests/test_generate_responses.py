"""``tools/generate_responses.py``: on-policy responses from an OpenAI-compatible endpoint.

- endpoint backend against a loopback OpenAI-compatible server (``FakeServer``): normal
  answers, retried timeouts / 5xx / 429, a permanent 500, malformed JSON and a 400 (one
  ``error:`` line each, the others written, exit status 1), concurrency, resume from a
  partial file with a truncated last line (only the missing samples are requested), a
  resume with other sampling settings (refused), duplicate prompts and ``--dedupe-responses``;
- CLI errors: one ``error:`` line and exit status 2.

The tool runs in-process (tests/helpers/generate_tool.py) to keep the file fast; one test
runs it as a subprocess. The HF backend: tests/test_generate_responses_hf.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bebop_megatron.cli import run_cli
from bebop_megatron.data.generate import (Completion, ExistingOutput, plan_jobs, read_prompts, run_generation,
                                           sample_seed)
from bebop_megatron.data.jsonl import read_jsonl
from bebop_megatron.data.tokenizer import ByteTokenizer
from tests.helpers.data import write_jsonl
from tests.helpers.generate_tool import TOOL_PATH, error_lines, interrupted_copy, read_out, run_tool
from tests.helpers.launch import REPO


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
        self.return_ids = False  # answer with vLLM's prompt_token_ids and choices[0].token_ids
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
            answer = {"id": "x", "object": "chat.completion", "model": body["model"],
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": reason}],
                      "usage": {"prompt_tokens": 3, "completion_tokens": len(text.split()),
                                "total_tokens": 3 + len(text.split())}}
            if self.return_ids and body.get("return_token_ids"):  # as vLLM answers: ids of the byte tokenizer
                answer["prompt_token_ids"] = [257, *message.encode()]
                answer["choices"][0]["token_ids"] = [*text.encode(), 258]
            handler.reply(200, answer)
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


@pytest.mark.parametrize("return_ids", [True, False])
def test_endpoint_token_ids_recorded_or_one_warning(tmp_path, capsys, server, return_ids):
    server.return_ids = return_ids
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hello"}, {"id": "b", "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    status, _, stderr = run_tool(capsys, "--prompts", prompts, "--out", out, "--endpoint", server.url, "--n", 2, *FAST)
    assert status == 0 and all(body["return_token_ids"] is True for body in server.bodies)
    records = read_out(out)
    warning = f"warning: {server.url} returns no token ids"
    if return_ids:
        assert warning not in stderr
        rec = records[('"a"', 1)]
        text = rec["messages"][-1]["content"]
        assert (rec["prompt_ids"], rec["response_ids"]) == ([257, *b"hello"], [*text.encode(), 258])
        # Training reads the ids (an id the text would not give: 258 = the byte tokenizer's EOS, as sampled).
        docs = read_jsonl(str(out), ByteTokenizer(), progress=False, log=lambda _: None)
        assert sorted(docs.get(j)[0].tolist() for j in range(4)) == \
            sorted(r["prompt_ids"] + r["response_ids"] for r in records.values())
    else:
        assert stderr.count(warning) == 1 and "writing the text only" in stderr
        assert all("response_ids" not in r and "prompt_ids" not in r for r in records.values())


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
    lines = interrupted_copy(full, partial, 5, 20)
    server.requests.clear()
    status, _, stderr = run_tool(capsys, *args, "--out", partial)
    assert status == 0
    assert "7 to generate, 5 already in" in stderr and "truncated last line" in stderr
    missing = set(read_out(full)) - {(json.dumps(r["id"]), r["sample"]) for r in map(json.loads, lines[:5])}
    assert sorted(server.requests) == sorted((f"question {json.loads(key)[1:]}", sample_seed(0, key, j) & 0x7FFFFFFF)
                                             for key, j in missing)
    assert read_out(partial) == read_out(full)  # same seeds: the same answers


def test_one_run_per_out(tmp_path, capsys, server):
    """(issue 36 item 9) Two runs on one --out both appended (70 lines for 36 samples): a live run
    holding <out>.lock refuses a second one in one line; a lock whose run is gone is taken over,
    and the lock is released at the end."""
    from bebop_megatron.training.lock import _process_start_time, this_run

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(3)])
    out, lock = tmp_path / "out.jsonl", tmp_path / "out.jsonl.lock"
    args = ["--prompts", prompts, "--endpoint", server.url, "--out", out, *FAST]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({**this_run(), "pid": other.pid, "process_start": _process_start_time(other.pid)}))
        status, _, stderr = run_tool(capsys, *args)
    finally:
        other.kill()
        other.wait()
    assert status == 2 and not out.exists() and not server.requests
    [line] = error_lines(stderr)
    assert line.startswith(f"error: --out {out} is in use by another run (pid {other.pid} on ") and line.endswith(
        f"; lock {lock}): wait for it to end or use another --out; if that run is gone, delete the lock file"), line
    status, _, stderr = run_tool(capsys, *args)  # its run is gone now: taken over
    assert status == 0 and f"--out {out}: taking over the lock of a run that is gone (pid {other.pid}" in stderr
    assert len(read_out(out)) == 3 and not lock.exists()


def test_resume_with_other_sampling_settings_is_refused(tmp_path, capsys, server):
    """The samples on file were counted as done whatever settings made them: they are recorded
    in <out>.settings.json and a resume with others is refused, naming them."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    args = ["--prompts", prompts, "--out", out, "--endpoint", server.url, "--n", 2, *FAST]
    assert run_tool(capsys, *args, "--temperature", 0.7, "--max-new-tokens", 50)[0] == 0
    record = json.loads((tmp_path / "out.jsonl.settings.json").read_text())
    assert record == {"model": "endpoint tiny-served", "max_new_tokens": 50, "temperature": 0.7, "top_p": 1.0,
                      "seed": 0}
    before, num_requests = out.read_bytes(), len(server.requests)
    for other, message in [
        (["--temperature", 1.0, "--max-new-tokens", 20, "--n", 3],
         "--max-new-tokens 50 there, 20 here; --temperature 0.7 there, 1.0 here;"),
        (["--temperature", 0.7, "--max-new-tokens", 50, "--model", "other"],
         'model "endpoint tiny-served" there, "endpoint other" here;'),
    ]:
        status, _, stderr = run_tool(capsys, *args, *other)
        assert status == 2 and len(error_lines(stderr)) == 1, stderr
        assert error_lines(stderr)[0] == (f"error: {out}: its 2 samples were made with other settings "
                                          f"({out}.settings.json): {message} resume with the same settings or pass "
                                          "another --out")
    assert out.read_bytes() == before and len(server.requests) == num_requests
    assert run_tool(capsys, *args, "--temperature", 0.7, "--max-new-tokens", 50, "--n", 3)[0] == 0  # the same: resumed
    assert len(read_out(out)) == 3

    # Samples without a record (an older version's output) are refused; an empty output takes new settings.
    (tmp_path / "out.jsonl.settings.json").rename(tmp_path / "kept.json")
    status, _, stderr = run_tool(capsys, *args)
    assert status == 2 and error_lines(stderr) == [
        f"error: {out}: holds 3 samples but no {out}.settings.json recording their sampling settings (made by an "
        "older version?); pass another --out"]
    out.write_bytes(b"")
    (tmp_path / "kept.json").rename(tmp_path / "out.jsonl.settings.json")
    assert run_tool(capsys, *args)[0] == 0
    assert json.loads((tmp_path / "out.jsonl.settings.json").read_text())["temperature"] == 1.0


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
    imported = tmp_path / "imported"  # convert_from_hf's output (it suggested installing sentencepiece)
    (imported / "hf").mkdir(parents=True)
    for name in ("metadata.json", "bebop_model.yaml", "hf/config.json"):
        (imported / name).write_text("{}")
    cases.append((["--prompts", prompts, "--hf-dir", imported],
                  f"--hf-dir {imported} is a Megatron checkpoint imported by tools/convert_from_hf.py, not a Hugging "
                  "Face model directory (config.json and *.safetensors): pass it as --megatron, or the Hugging Face "
                  "model, e.g. the --hf-dir it was imported from, or serve the model and pass --endpoint"))
    for args, message in cases:
        status, _, stderr = run_tool(capsys, *args, "--out", out)
        assert status == 2, (args, stderr)
        assert len(error_lines(stderr)) == 1 and message in error_lines(stderr)[0], (args, stderr)
        assert "Traceback" not in stderr


def _failing_writes_under(monkeypatch, folder, code: int) -> None:
    """Opening a file under ``folder`` for writing fails with ``OSError(code)``, as on a read-only
    file system (the tests run as root, whom chmod does not stop)."""
    import os

    real_open, real_builtin_open = os.open, open
    flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def under(path) -> bool:
        return str(os.path.abspath(path)).startswith(str(folder) + os.sep)

    def fake_os_open(path, flag, *a, **k):
        if under(path) and flag & flags:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flag, *a, **k)

    def fake_open(path, mode="r", *a, **k):
        if isinstance(path, (str, os.PathLike)) and under(path) and set(mode) & set("wax+"):
            raise OSError(code, os.strerror(code), str(path))
        return real_builtin_open(path, mode, *a, **k)

    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr("builtins.open", fake_open)


def test_out_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch, server):
    """(issue 48 item 11) --out in a directory that does not exist: FileNotFoundError on <out>.lock;
    --out on a read-only file system: a traceback. Now one line each, exit 2, before any request,
    and nothing is created."""
    import errno

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    args = ["--prompts", prompts, "--endpoint", server.url, *FAST]
    missing = tmp_path / "missing" / "dir" / "x.jsonl"
    status, _, stderr = run_tool(capsys, *args, "--out", missing)
    assert status == 2 and "Traceback" not in stderr
    assert error_lines(stderr) == [f"error: --out {missing}: the directory {missing.parent} does not exist; "
                                   "create it first"]
    assert not (tmp_path / "missing").exists() and not server.requests

    readonly = tmp_path / "ro"
    readonly.mkdir()
    out = readonly / "x.jsonl"
    _failing_writes_under(monkeypatch, readonly, errno.EROFS)
    status, _, stderr = run_tool(capsys, *args, "--out", out)
    monkeypatch.undo()
    assert status == 2 and "Traceback" not in stderr
    assert error_lines(stderr) == [f"error: --out {out} cannot be written (Read-only file system: {out}.lock)"]
    assert list(readonly.iterdir()) == [] and not server.requests
    assert prompts.read_text() == '{"id": "a", "prompt": "hi"}\n'


def test_full_disk_is_one_line_with_exit_74(tmp_path, capsys, monkeypatch, server):
    """A full disk at the lock (its write fails after the file was created: no empty lock is left
    to refuse the next run) and in the middle of the run (the samples written so far stay, and
    the same command resumes): one line, exit status 74."""
    import errno
    import os

    import bebop_megatron.data.generate as generate

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(3)])
    out = tmp_path / "out.jsonl"
    args = ["--prompts", prompts, "--endpoint", server.url, "--out", out, *FAST]
    real_fsync = os.fsync

    def full_fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what write() raises: no file name

    monkeypatch.setattr(os, "fsync", full_fsync)
    status, _, stderr = run_tool(capsys, *args)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert status == 74 and "Traceback" not in stderr
    assert error_lines(stderr) == [f"error: --out {out}: no space left on device while writing {out}"]
    assert list(tmp_path.iterdir()) == [prompts] and not server.requests

    class FullAfter:  # the output file: room for 2 samples
        def __init__(self, f):
            self.f, self.lines = f, 0

        def write(self, data):
            if self.lines == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.lines += 1
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(generate, "open", lambda path, mode="r", *a, **k: FullAfter(open(path, mode)) if mode == "ab"
                        else open(path, mode, *a, **k), raising=False)
    status, _, stderr = run_tool(capsys, *args)
    monkeypatch.undo()
    assert status == 74 and "Traceback" not in stderr
    assert error_lines(stderr) == [f"error: --out {out}: no space left on device while writing {out}; 2 samples "
                                   "written in this run (run the same command again to resume)"]
    assert len(read_out(out)) == 2 and not (tmp_path / "out.jsonl.lock").exists()
    status, _, stderr = run_tool(capsys, *args)
    assert status == 0 and "1 to generate, 2 already in" in stderr
    assert len(read_out(out)) == 3


def test_cli_subprocess_malformed_line(tmp_path):
    """The real entry point: one error line naming PATH:LINE, status 2, no traceback."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, '{"prompt": 3}'])
    proc = subprocess.run([sys.executable, str(TOOL_PATH), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                           "--endpoint", "http://127.0.0.1:9"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {prompts}:2: field 'prompt' must be a non-empty string, got number"
