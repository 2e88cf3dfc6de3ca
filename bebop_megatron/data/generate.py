"""On-policy chat data: the model's own responses to a prompts file, as trainable JSONL.

The backend-independent part of ``tools/generate_responses.py``: reading and checking the
prompts, per-sample seeds, resuming a partial output file, and the loop that appends every
finished sample. The backends are :mod:`bebop_megatron.data.generate_hf` (transformers,
local weights) and :mod:`bebop_megatron.data.generate_endpoint` (an OpenAI-compatible
server such as vLLM or SGLang); each has ``generate(jobs)`` yielding ``(job, result)`` pairs
as they finish, where ``result`` is a :class:`Completion` or a :class:`Failure`.

Prompt lines: ``{"id": ..., "prompt": "text"}`` or ``{"id": ..., "messages": [...]}``; the
optional ``id`` (string or integer) defaults to a hash of the messages, and any other field
(e.g. ``source``) is carried to the output. Output lines (what :mod:`bebop_megatron.data.jsonl`
reads)::

    {"id": ID, "sample": j, "messages": [...prompt..., {"role": "assistant", "content": TEXT}],
     "prompt_ids": [...], "response_ids": [...],
     "finish_reason": "stop" | "length", "num_tokens": N, ...carried fields}

``prompt_ids`` (the chat-template rendering the model was given) and ``response_ids`` (the ids
it sampled, its end-of-turn token included when it stopped) are written when the backend knows
them: always with transformers, with a server that returns them (vLLM's ``return_token_ids``).
The trainer reads the ids in preference to the text, so a sample trains on exactly the tokens
the policy emitted (decoding and re-encoding does not give them back in general).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Protocol, Union

from tqdm import tqdm

from bebop_megatron.data.errors import DataError, malformed_json
from bebop_megatron.platform.atomic import write_atomic

# Output keys a prompt line may not carry as an extra field (they would be overwritten).
RESERVED_FIELDS = ("sample", "finish_reason", "num_tokens", "prompt_ids", "response_ids")


@dataclass
class Prompt:
    id: Union[str, int]  # as given (or the default hash); written back unchanged
    messages: list[dict]
    extra: dict  # carried fields, in input order
    line: int

    @property
    def key(self) -> str:
        """Identity of the prompt in the output: 5 and "5" are different ids."""
        return json.dumps(self.id)


@dataclass
class Job:
    prompt: Prompt
    sample: int
    seed: int  # this sample's seed (see :func:`sample_seed`)


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" (end of turn) or "length" (max_new_tokens reached)
    num_tokens: int  # generated tokens, the end-of-turn token included
    prompt_ids: Optional[list[int]] = None  # the ids the model was given (chat template, generation prompt)
    response_ids: Optional[list[int]] = None  # the ids it sampled, the end-of-turn token included; None: unknown


@dataclass
class Failure:
    message: str  # one line, says what went wrong for this sample


class Backend(Protocol):
    def generate(self, jobs: list[Job]) -> Iterator[tuple[Job, Union[Completion, Failure]]]: ...


def sample_seed(seed: int, key: str, sample: int) -> int:
    """63-bit seed of one sample: depends only on the run seed, the prompt id and the sample
    index, so a sample's randomness does not change with batching, order or resuming."""
    digest = hashlib.sha256(json.dumps([seed, key, sample]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ----------------------------------------------------------------------------- prompts


def _type_name(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def parse_prompt(obj, lineno: int, drop_response: bool = False) -> Prompt:
    """One prompt line (parsed JSON); raises ``ValueError`` with what is wrong (no path).

    A data line's answer (the ``response`` of a ``prompt``/``response`` line, the trailing
    assistant message of a ``messages`` line) is dropped with ``drop_response`` (a held-out
    data file used as prompts) and refused without it: there would be nothing to respond to.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {_type_name(obj)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError("needs exactly one of 'prompt' (a string) and 'messages' (an array)"
                         + (", got both" if "prompt" in obj else ""))
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"field 'prompt' must be a non-empty string, got {_type_name(text)}"
                             if not isinstance(text, str) else "field 'prompt' is empty")
        messages = [{"role": "user", "content": text}]
    else:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("field 'messages' must be a non-empty array" +
                             ("" if isinstance(messages, list) else f", got {_type_name(messages)}"))
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise ValueError(f"messages[{i}] must be an object, got {_type_name(msg)}")
            for name in ("role", "content"):
                if not isinstance(msg.get(name), str):
                    raise ValueError(f"messages[{i}].{name} must be a string, got {_type_name(msg.get(name))}")
        if messages[-1]["role"] == "assistant" and drop_response:
            messages = messages[:-1]
            if not messages:
                raise ValueError("'messages' holds only an assistant message: there is no prompt")
        if messages[-1]["role"] == "assistant":
            raise ValueError("the last message is an assistant message: there is nothing to respond to")
    if "id" in obj:
        pid = obj["id"]
        if isinstance(pid, bool) or not isinstance(pid, (str, int)) or pid == "":
            raise ValueError(f"field 'id' must be a non-empty string or an integer, got {json.dumps(pid)}")
    else:  # stable across runs and machines: a resume finds the same ids
        pid = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    for name in RESERVED_FIELDS:
        if name in obj:
            raise ValueError(f"field {name!r} is reserved for the output (is this an output file?)")
    if "response" in obj and not drop_response:
        raise ValueError("field 'response' is an answer: a prompts line has none (is this a data file?)")
    extra = {k: v for k, v in obj.items() if k not in ("id", "prompt", "messages", "response")}
    return Prompt(pid, messages, extra, lineno)


@dataclass
class PromptSet:
    prompts: list[Prompt]
    num_duplicates: int  # lines dropped because an earlier line has the same messages


def read_prompts(path: str, limit: Optional[int] = None, drop_response: bool = False) -> PromptSet:
    """The distinct prompts of ``path`` in file order (the first ``limit`` of them when given).

    ``drop_response``: see :func:`parse_prompt`.
    A prompt whose messages equal an earlier one's is dropped (generated once); two lines
    with the same id but different messages are an error. Blank lines are ignored.
    Raises :class:`DataError` ``PATH:LINE: what is wrong``.
    """
    if not os.path.isfile(path):
        raise DataError(f"prompts file not found: {path}")
    prompts, by_messages, by_key, num_duplicates = [], {}, {}, 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and len(prompts) >= limit:
                break
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte {err.start + 1})") from None
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: {malformed_json(err)}") from None
            try:
                prompt = parse_prompt(obj, lineno, drop_response)
            except ValueError as err:
                raise DataError(f"{path}:{lineno}: {err}") from None
            content = json.dumps(prompt.messages, sort_keys=True)
            if content in by_messages:
                num_duplicates += 1
                continue
            if prompt.key in by_key:
                raise DataError(f"{path}:{lineno}: duplicate id {prompt.key} (line {by_key[prompt.key]} has the "
                                "same id with different messages)")
            by_messages[content] = prompt
            by_key[prompt.key] = lineno
            prompts.append(prompt)
    if not prompts:
        raise DataError(f"{path}: no prompt in the file (it is empty or blank)")
    return PromptSet(prompts, num_duplicates)


# ----------------------------------------------------------------------------- resume


def response_digest(text: str) -> bytes:
    """What ``--dedupe-responses`` compares (16 bytes, not the text: outputs can be large)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


@dataclass
class ExistingOutput:
    done: set = field(default_factory=set)  # (prompt key, sample) already in the file
    responses: dict = field(default_factory=dict)  # prompt key -> set of response digests
    num_lines: int = 0
    truncated: bool = False  # a partial last line was cut away


def load_existing(path: str, track_responses: bool = False) -> ExistingOutput:
    """What a previous (interrupted) run already wrote to ``path`` (with ``track_responses``,
    also its responses' digests, for ``--dedupe-responses``).

    A last line without its newline is an interrupted write: it is cut off the file so the
    appends that follow start on a fresh line. Any other unreadable line is an error, since
    overwriting or ignoring someone's data silently is worse than stopping.
    """
    state = ExistingOutput()
    if not os.path.exists(path):
        return state
    with open(path, "rb+") as f:
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):  # only the last line can lack it
                f.truncate(offset)
                state.truncated = True
                break
            offset += len(raw)
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
                key, sample, response = json.dumps(obj["id"]), obj["sample"], obj["messages"][-1]["content"]
                if track_responses:
                    state.responses.setdefault(key, set()).add(response_digest(response))
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
                reason = malformed_json(err) if isinstance(err, json.JSONDecodeError) else f"{type(err).__name__}: {err}"
                raise DataError(f"{path}:{lineno}: cannot resume from this output file: not a generated sample "
                                f"({reason}); pass another --out") from None
            state.done.add((key, sample))
            state.num_lines += 1
    return state


def settings_path(out_path: str) -> str:
    """The sidecar recording the sampling settings of ``out_path``'s samples (the output
    itself stays a plain JSONL that the trainer reads)."""
    return out_path + ".settings.json"


def check_settings(out_path: str, settings: dict, num_existing: int) -> None:
    """Refuse to resume ``out_path`` (``num_existing`` samples on file) with other sampling
    ``settings`` than its samples were made with, or with unknown ones: one ``DataError``
    line naming every differing setting."""
    if not num_existing:
        return  # nothing to mix with: the settings are (re)written
    path = settings_path(out_path)
    if not os.path.isfile(path):
        raise DataError(f"{out_path}: holds {num_existing} samples but no {path} recording their sampling settings "
                        "(made by an older version?); pass another --out")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot read the settings record ({' '.join(str(err).split())}); "
                        "pass another --out") from None
    saved = saved if isinstance(saved, dict) else {}
    differ = [f"{name if name == 'model' else '--' + name.replace('_', '-')} {json.dumps(saved.get(name))} there, "
              f"{json.dumps(value)} here" for name, value in settings.items() if saved.get(name) != value]
    if differ:
        raise DataError(f"{out_path}: its {num_existing} samples were made with other settings ({path}): "
                        f"{'; '.join(differ)}; resume with the same settings or pass another --out")


def write_settings(out_path: str, settings: dict) -> None:
    path = settings_path(out_path)
    write_atomic(path, json.dumps(settings, indent=1) + "\n")


def plan_jobs(prompts: Iterable[Prompt], n: int, seed: int, done: set) -> list[Job]:
    """The (prompt, sample) pairs still missing, prompt by prompt."""
    return [Job(p, j, sample_seed(seed, p.key, j)) for p in prompts for j in range(n) if (p.key, j) not in done]


# ----------------------------------------------------------------------------- the loop


@dataclass
class Summary:
    num_written: int = 0
    num_tokens: int = 0  # generated tokens, dropped samples included
    num_failed: int = 0
    num_duplicate_responses: int = 0
    num_empty: int = 0
    seconds: float = 0.0

    def line(self, out_path: str) -> str:
        rate = self.num_tokens / max(self.seconds, 1e-9)
        dropped = [f"{k} {what}" for k, what in ((self.num_duplicate_responses, "duplicate responses"),
                                                  (self.num_empty, "empty responses")) if k]
        return (f"done: {self.num_written} samples written to {out_path}"
                + (f" ({', '.join(dropped)} dropped)" if dropped else "")
                + f", {self.num_tokens:,} tokens in {self.seconds:.1f} s ({rate:,.0f} tokens/s), "
                f"{self.num_failed} failed")


def output_record(job: Job, result: Completion) -> dict:
    messages = job.prompt.messages + [{"role": "assistant", "content": result.text}]
    ids = {} if result.response_ids is None or result.prompt_ids is None else {
        "prompt_ids": result.prompt_ids, "response_ids": result.response_ids}
    return {"id": job.prompt.id, "sample": job.sample, "messages": messages, **ids,
            "finish_reason": result.finish_reason, "num_tokens": result.num_tokens, **job.prompt.extra}


def output_line(job: Job, result: Completion) -> bytes:
    """The output line of a sample, as :func:`run_generation` writes it (UTF-8, newline ended);
    raises ``UnicodeEncodeError`` for an answer holding a lone surrogate. The objective study's
    ``--unpack`` (:mod:`bebop_megatron.study.pack`) rebuilds lines with it."""
    return (json.dumps(output_record(job, result), ensure_ascii=False) + "\n").encode("utf-8")


class _OutputError(Exception):
    """The OSError of writing the output file (not one of a backend's), carried out of the loop."""


@contextlib.contextmanager
def _appending(path: str):
    try:
        f = open(path, "ab")
    except OSError as err:
        raise _OutputError(err) from None
    try:
        yield f
    except BaseException:
        with contextlib.suppress(OSError):  # a failed write's bytes are still buffered: close() fails too
            f.close()
        raise
    try:
        f.close()
    except OSError as err:
        raise _OutputError(err) from None


def run_generation(backend: Backend, jobs: list[Job], out_path: str, existing: ExistingOutput, *,
                   dedupe_responses: bool = False, progress: bool = True) -> Summary:
    """Generate ``jobs`` with ``backend``, appending each kept sample to ``out_path`` at once.

    Empty responses are dropped (the JSONL reader rejects an empty assistant message), and
    with ``dedupe_responses`` so is a response equal to one already written for the same
    prompt (earlier in completion order). Dropped and failed samples are not written, so a
    rerun tries them again. Failures print one ``error:`` line each. On Ctrl-C, says how
    many samples were written and re-raises ``KeyboardInterrupt``; a sample that cannot be
    written (a full disk) stops the run with one line saying how many were
    (:func:`bebop_megatron.cli.output_write_error`).
    """
    summary, start = Summary(), time.perf_counter()
    bar = tqdm(total=len(jobs), unit="sample", desc="generating", file=sys.stderr, dynamic_ncols=True,
               disable=True if not progress else None)  # None: only on a TTY
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    try:
        with _appending(out_path) as f, bar:
            for job, result in backend.generate(jobs):
                bar.update(1)
                summary.seconds = time.perf_counter() - start
                if isinstance(result, Completion):
                    try:  # JSON can carry a lone surrogate ("\\ud800"), which UTF-8 cannot encode
                        line = output_line(job, result)
                    except UnicodeEncodeError as err:
                        result = Failure(f"the answer is not valid Unicode ({err.reason})")
                if isinstance(result, Failure):
                    summary.num_failed += 1
                    tqdm.write(f"error: prompt {job.prompt.key} (line {job.prompt.line}) sample {job.sample}: "
                               f"{result.message}", file=sys.stderr)
                    continue
                summary.num_tokens += result.num_tokens
                bar.set_postfix_str(f"{summary.num_tokens / max(summary.seconds, 1e-9):,.0f} tok/s", refresh=False)
                if not result.text.strip():
                    summary.num_empty += 1
                    continue
                if dedupe_responses:
                    seen, digest = existing.responses.setdefault(job.prompt.key, set()), response_digest(result.text)
                    if digest in seen:
                        summary.num_duplicate_responses += 1
                        continue
                    seen.add(digest)
                try:
                    f.write(line)
                    f.flush()  # an interrupted run keeps every finished sample
                except OSError as err:
                    raise _OutputError(err) from None
                summary.num_written += 1
    except _OutputError as failed:
        from bebop_megatron.platform.outputs import output_write_error

        raise output_write_error(failed.args[0], "--out", out_path, f"{summary.num_written} samples written in "
                                 "this run (run the same command again to resume)") from None
    except KeyboardInterrupt:
        print(f"\ninterrupted: {summary.num_written} samples written to {out_path} in this run "
              "(run the same command again to resume)", file=sys.stderr)
        raise
    summary.seconds = time.perf_counter() - start
    return summary
