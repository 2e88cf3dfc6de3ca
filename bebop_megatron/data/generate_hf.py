"""Generation backend: a transformers causal LM from a local directory.

Batched ``model.generate`` with left padding, but the sampling is ours: a logits processor
draws each row's token from the row's own ``torch.Generator`` (seeded with the sample's
seed, :func:`bebop_megatron.data.generate.sample_seed`) by inverse CDF, then hands
``generate`` a one-hot choice to take greedily. Reproducibility guarantee:

- the t-th token of a sample uses the t-th uniform of its own stream, whatever else is in
  the batch, so the same seed gives the same text for any batch size, order or resume,
  *as long as the model computes the same logits for that sample*;
- batching can change the logits at the rounding level (padding changes the shapes the
  kernels see), which changes a token only when a uniform falls within that distance of a
  boundary between two tokens' cumulative probabilities (:func:`sample_tokens` inverts the
  CDF in vocabulary order for that reason): in float32 this practically never happens
  (tested across batch sizes and resume); in bf16 it occasionally does.

Tensor legend: B batch rows, V vocabulary.
"""

from __future__ import annotations

import os
from typing import Iterator, Union

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList

from bebop_megatron.data.generate import Completion, Failure, Job


def sample_tokens(logits_BV: torch.Tensor, uniforms_B: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Token ids [B] drawn from ``softmax(logits / temperature)`` restricted to the top-p nucleus.

    Plain-torch equivalent per row (float64): ``p = softmax(logits / T)``; keep token ``i``
    when the mass of the tokens sorted before it (decreasing ``p``, stable) is ``< top_p``;
    return the first token *in vocabulary order* whose cumulative kept probability exceeds
    ``u * kept_mass``. ``temperature == 0`` is greedy. Inverting the CDF in vocabulary order
    (not sorted order) makes a rounding-level change of the logits move the boundaries by a
    rounding-level amount, instead of swapping two nearly tied tokens' intervals.
    """
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV.double() / temperature, dim=-1)
    if top_p < 1:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True, stable=True)
        keep_BV = torch.empty_like(probs_BV, dtype=torch.bool)
        keep_BV.scatter_(1, order_BV, (sorted_BV.cumsum(dim=-1) - sorted_BV) < top_p)  # the top token always stays
        probs_BV = probs_BV * keep_BV
    cum_BV = probs_BV.cumsum(dim=-1)
    target_B1 = uniforms_B.to(cum_BV).unsqueeze(-1) * cum_BV[:, -1:]
    return torch.searchsorted(cum_BV, target_B1, right=True).clamp_(max=cum_BV.shape[-1] - 1).squeeze(-1)


class _RowSampler(LogitsProcessor):
    """A ``generate`` logits processor: row ``b`` draws one uniform per step from its own
    generator, so its t-th token always uses the t-th uniform of its sample's stream."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores_BV: torch.Tensor) -> torch.Tensor:
        uniforms_B = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.generators])
        tokens_B = sample_tokens(scores_BV, uniforms_B.to(scores_BV.device), self.temperature, self.top_p)
        choice_BV = torch.full_like(scores_BV, float("-inf"))
        return choice_BV.scatter_(1, tokens_B.unsqueeze(1), 0.0)


def resolve_device_dtype(device: str, dtype: str) -> tuple[str, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" else "fp32"
    return device, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]


def end_of_turn_ids(generation_eos, tokenizer, where: str) -> list[int]:
    """End of turn: the checkpoint's generation config's EOS (e.g. Qwen's <|im_end|>) and the
    tokenizer's EOS."""
    eos = [] if generation_eos is None else [generation_eos] if isinstance(generation_eos, int) else list(generation_eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    if not eos:
        raise ValueError(f"{where}: neither generation_config.json nor the tokenizer names an EOS token")
    return eos


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids a backend gives the model for ``messages``: the chat template's rendering with the
    assistant's generation prompt, tokenized without adding special tokens (the template already
    holds those it wants: BOS, role markers). Needs only the tokenizer (the study's ``--unpack``
    renders the generator's ``prompt_ids`` with it, without loading the model)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ChatPrompts:
    """The prompt ids and the completions of a backend with a transformers tokenizer
    (``self.tokenizer``, ``self.eos_ids``); shared by :class:`HFBackend` and the Megatron
    backend (:mod:`bebop_megatron.speculative.generate_backend`)."""

    tokenizer = None
    eos_ids: list[int] = []

    def prompt_ids(self, job: Job) -> list[int]:
        """The chat-template rendering of the prompt with the assistant's generation prompt."""
        cache = self.__dict__.setdefault("_prompt_ids", {})
        key = job.prompt.key
        if key not in cache:
            cache[key] = chat_prompt_ids(self.tokenizer, job.prompt.messages)
        return cache[key]

    def ready_batches(self, jobs: list[Job], batch_size: int):
        """``(failures, [(job, prompt ids)])`` per batch of ``batch_size`` jobs, in order."""
        for lo in range(0, len(jobs), batch_size):
            failures, ready = [], []
            for job in jobs[lo:lo + batch_size]:
                try:
                    ready.append((job, self.prompt_ids(job)))
                except Exception as err:  # a template that rejects this conversation (e.g. a role)
                    failures.append((job, Failure(f"chat template failed: {type(err).__name__}: "
                                                  f"{' '.join(str(err).split())}")))
            yield failures, ready

    def completion(self, prompt: list[int], new: list[int]) -> Completion:
        """The sampled ids ``new`` (cut at the first end of turn, which is kept in the ids, not
        in the text) as a Completion; no end of turn: ``finish_reason`` "length"."""
        stop = next((i for i, token in enumerate(new) if token in self.eos_ids), None)
        tokens = new if stop is None else new[:stop]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        sampled = list(new) if stop is None else list(new[: stop + 1])  # the ids as sampled, the EOS included
        return Completion(text, "length" if stop is None else "stop", len(sampled), prompt_ids=list(prompt),
                          response_ids=sampled)


def load_chat_tokenizer(path: str, where: str):
    """``AutoTokenizer`` of ``path``, which must have a chat template."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{where}: cannot load its tokenizer "
                         f"({type(err).__name__}: {' '.join(str(err).split())[:300]})") from None
    if not tokenizer.chat_template:
        raise ValueError(f"{where}: the tokenizer has no chat template")
    return tokenizer


class HFBackend(ChatPrompts):
    """``AutoModelForCausalLM`` + ``AutoTokenizer`` (with a chat template) from ``hf_dir``."""

    def __init__(self, hf_dir: str, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 batch_size: int = 8, device: str = "auto", dtype: str = "auto", threads: int | None = None):
        if not os.path.isdir(hf_dir):
            raise ValueError(f"--hf-dir {hf_dir}: not a directory")
        if threads:
            torch.set_num_threads(threads)
        self.device, torch_dtype = resolve_device_dtype(device, dtype)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch_dtype)
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"--hf-dir {hf_dir}: cannot load a causal LM and its tokenizer "
                             f"({type(err).__name__}: {' '.join(str(err).split())[:300]})") from None
        if not self.tokenizer.chat_template:
            raise ValueError(f"--hf-dir {hf_dir}: the tokenizer has no chat template")
        self.model.to(self.device).eval()
        self.eos_ids = eos = end_of_turn_ids(self.model.generation_config.eos_token_id, self.tokenizer,
                                             f"--hf-dir {hf_dir}")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        # generate() fills unset options from the checkpoint's generation config (top_k,
        # repetition_penalty, ...); the sampling here is entirely ours, so start from none.
        self.model.generation_config = GenerationConfig()
        self.gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                           pad_token_id=self.pad_id)
        self.temperature, self.top_p, self.batch_size = temperature, top_p, batch_size

    def generate(self, jobs: list[Job]) -> Iterator[tuple[Job, Union[Completion, Failure]]]:
        for failures, ready in self.ready_batches(jobs, self.batch_size):
            yield from failures
            if ready:
                yield from self._generate_batch(ready)

    @torch.inference_mode()
    def _generate_batch(self, batch: list[tuple[Job, list[int]]]) -> Iterator[tuple[Job, Completion]]:
        length = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
        for row, (_, ids) in enumerate(batch):  # left padding: every row's next token is at the end
            input_ids[row, length - len(ids):] = torch.tensor(ids)
            attention_mask[row, length - len(ids):] = 1
        sampler = _RowSampler([job.seed for job, _ in batch], self.temperature, self.top_p)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                  generation_config=self.gen_config, logits_processor=LogitsProcessorList([sampler]))
        for (job, prompt), new in zip(batch, out[:, length:].tolist()):
            # generate() ends a row at its EOS (and pads it); a row without one ran to max_new_tokens.
            yield job, self.completion(prompt, new)
