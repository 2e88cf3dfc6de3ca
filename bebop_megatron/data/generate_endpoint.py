"""Generation backend: an OpenAI-compatible chat-completions server (vLLM, SGLang, ...).

One ``POST {URL}/v1/chat/completions`` per sample (``n=1``, the sample's own ``seed``, so a
server that honours per-request seeds reproduces it; ``return_token_ids``, so that vLLM returns
the prompt's and the sampled ids, recorded next to the text; a server that returns none gets one
warning and text-only samples), ``--concurrency`` requests in flight
on daemon threads, standard library HTTP only. A request is retried with exponential
backoff on connection errors, timeouts, HTTP 429 and 5xx; any other HTTP error, and an
answer that is not the expected JSON, fails the sample at once with a one-line reason.
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator, Optional, Union

from bebop_megatron.data.generate import Completion, Failure, Job

MAX_BACKOFF_S = 60.0


class RequestFailed(Exception):
    """A request that will not be retried (any more); the message is one line."""


def base_url(url: str) -> str:
    """``http://host:port`` from the URL with or without ``/v1`` (or ``/v1/chat/completions``)."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--endpoint {url!r}: expected an http:// or https:// URL")
    for suffix in ("/chat/completions", "/v1"):
        base = base.removesuffix(suffix)
    return base


def _excerpt(raw: bytes, limit: int = 200) -> str:
    text = " ".join(raw.decode("utf-8", errors="replace").split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_completion(raw: bytes) -> Union[Completion, Failure]:
    """A chat-completions answer as a :class:`Completion`, or why it is not one."""
    try:
        obj = json.loads(raw)
    except ValueError as err:  # also UnicodeDecodeError
        return Failure(f"malformed answer, not JSON ({err}): {_excerpt(raw)}")
    try:
        choice, num_tokens = obj["choices"][0], obj["usage"]["completion_tokens"]
        text, reason = choice["message"]["content"], choice["finish_reason"]
    except (KeyError, IndexError, TypeError):
        return Failure("malformed answer, expected choices[0].message.content, choices[0].finish_reason and "
                       f"usage.completion_tokens: {_excerpt(raw)}")
    if not isinstance(text, str):
        return Failure(f"malformed answer, message.content is {json.dumps(text)}: {_excerpt(raw)}")
    if reason not in ("stop", "length"):
        return Failure(f"unexpected finish_reason {reason!r} (expected 'stop' or 'length')")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        return Failure(f"malformed answer, usage.completion_tokens is {json.dumps(num_tokens)}")
    # The sampled ids, where the server returns them (vLLM with return_token_ids: the top level's
    # prompt_token_ids and the choice's token_ids; some servers name the latter response_token_ids).
    prompt_ids = obj.get("prompt_token_ids", choice.get("prompt_token_ids"))
    response_ids = choice.get("token_ids", choice.get("response_token_ids"))
    if not (_is_ids(prompt_ids) and _is_ids(response_ids) and response_ids):
        prompt_ids = response_ids = None
    return Completion(text, reason, num_tokens, prompt_ids=prompt_ids, response_ids=response_ids)


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


class EndpointBackend:
    def __init__(self, url: str, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 model: Optional[str] = None, api_key: Optional[str] = None, concurrency: int = 16,
                 timeout: float = 600.0, retries: int = 3, backoff: float = 1.0):
        self.base = base_url(url)
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.concurrency, self.timeout, self.retries, self.backoff = concurrency, timeout, retries, backoff
        self.warned_no_ids = False
        self.model = model or self.first_model()

    def first_model(self) -> str:
        """The first id of ``GET /v1/models`` (a vLLM/SGLang server serves one model)."""
        try:
            raw = self.request("/v1/models")
            return json.loads(raw)["data"][0]["id"]
        except RequestFailed as err:
            problem = str(err)
        except (ValueError, KeyError, IndexError, TypeError):
            problem = f"unexpected answer {_excerpt(raw)}"
        raise ValueError(f"--endpoint: cannot list the served models at {self.base}/v1/models: {problem} "
                         "(is the server up? or pass --model)")

    def request(self, path: str, body: Optional[dict] = None, stop: Optional[threading.Event] = None) -> bytes:
        """The answer's bytes (GET, or POST of ``body``), retried; raises :class:`RequestFailed`."""
        url = self.base + path
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            try:
                req = urllib.request.Request(url, data=data, headers=self.headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return resp.read()
            except urllib.error.HTTPError as err:  # before URLError: it is one
                try:
                    detail = _excerpt(err.read())
                except (OSError, http.client.HTTPException):
                    detail = "(no body)"
                problem = f"HTTP {err.code} from {url}: {detail}"
                if err.code < 500 and err.code != 429:  # the request itself is wrong: same answer next time
                    raise RequestFailed(problem + " (not retried)") from None
            except TimeoutError:
                problem = f"no answer from {url} within --timeout {self.timeout:g} s"
            except urllib.error.URLError as err:
                problem = (f"no answer from {url} within --timeout {self.timeout:g} s"
                           if isinstance(err.reason, TimeoutError) else f"cannot connect to {url}: {err.reason}")
            except (http.client.HTTPException, OSError) as err:  # dropped connection, reset, ...
                problem = f"connection to {url} lost: {type(err).__name__}: {err}"
            if attempt < self.retries:
                delay = min(self.backoff * 2 ** attempt, MAX_BACKOFF_S) * random.uniform(1.0, 1.25)  # jitter
                if stop is None:
                    time.sleep(delay)
                elif stop.wait(delay):  # the run is being interrupted
                    raise RequestFailed("interrupted")
        raise RequestFailed(f"{problem} (after {self.retries + 1} attempts)")

    def complete(self, job: Job, stop: Optional[threading.Event] = None) -> Union[Completion, Failure]:
        body = {"model": self.model, "messages": job.prompt.messages, "temperature": self.temperature,
                "top_p": self.top_p, "max_tokens": self.max_new_tokens, "n": 1,
                "seed": job.seed & 0x7FFFFFFF,  # 31 bits: some servers keep the seed in an int32
                "return_token_ids": True}  # vLLM: the sampled ids; servers that do not know it ignore it
        try:
            result = parse_completion(self.request("/v1/chat/completions", body, stop))
        except RequestFailed as err:
            return Failure(str(err))
        if isinstance(result, Completion) and result.response_ids is None and not self.warned_no_ids:
            self.warned_no_ids = True  # once per run: the answers of one server all look alike
            print(f"warning: {self.base} returns no token ids (prompt_token_ids and choices[0].token_ids, as vLLM "
                  "does for return_token_ids): writing the text only, which training re-tokenizes", file=sys.stderr)
        return result

    def generate(self, jobs: list[Job]) -> Iterator[tuple[Job, Union[Completion, Failure]]]:
        """Results in completion order. The workers are daemon threads, so Ctrl-C (raised in
        the caller's wait) does not wait for the requests still in flight."""
        todo, results, stop = queue.Queue(), queue.Queue(), threading.Event()
        for job in jobs:
            todo.put(job)

        def worker() -> None:
            while not stop.is_set():
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    results.put((job, self.complete(job, stop)))
                except Exception as err:  # a bug must not leave the caller waiting forever
                    results.put((job, Failure(f"internal error: {type(err).__name__}: {err}")))

        for _ in range(min(self.concurrency, len(jobs))):
            threading.Thread(target=worker, daemon=True).start()
        try:
            for _ in range(len(jobs)):
                while True:
                    try:  # a timeout, so that a Ctrl-C delivered to a worker thread is seen here too
                        item = results.get(timeout=0.5)
                        break
                    except queue.Empty:
                        continue
                yield item
        finally:
            stop.set()
