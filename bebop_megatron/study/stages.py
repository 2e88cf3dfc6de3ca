"""The objective study's preparation stages: the Megatron import, the model's own responses and
their indexed datasets. Each resumes from the work directory: a finished stage is skipped (its
folder holds :data:`DONE`), a killed one is redone (the import) or continued (the responses:
the samples already written are kept, :func:`bebop_megatron.data.generate.load_existing`)."""

from __future__ import annotations

import errno
import os
import shutil
import time
import traceback
from pathlib import Path
from types import TracebackType

from bebop_megatron.study.log import DISK_ERRNOS, StudyError, log, write_error

DONE = ".complete"
SPLITS = ("heldout", "train")
"""The responses at the sampling temperature (T=1): ``heldout`` (the curves' and the T=1 evaluation's
text) and ``train``; each other evaluation temperature T gets its own held-out split
(:func:`heldout_split`), the same held-out prompts answered at T."""


def heldout_split(temperature: float) -> str:
    """The held-out split of text sampled at ``temperature``: ``heldout`` at T=1, ``heldout_t0p7`` at 0.7
    (no dot: the split is also an indexed dataset's prefix)."""
    return "heldout" if temperature == 1.0 else f"heldout_t{temperature:g}".replace(".", "p")


def is_heldout(split: str) -> bool:
    return split == "heldout" or split.startswith("heldout_t")


def splits_on_file(data: Path) -> list[str]:
    """The response splits ``data`` holds: :data:`SPLITS` and each other temperature's held-out split."""
    return [*SPLITS, *sorted(p.stem for p in data.glob("heldout_t*.jsonl"))]


def response_splits(temperatures=()) -> dict[str, float | None]:
    """``{split: its sampling temperature}``: :data:`SPLITS` at the stage's own temperature (None here)
    and a held-out split per other evaluation temperature."""
    out: dict[str, float | None] = {split: None for split in SPLITS}
    for tau in temperatures:
        if heldout_split(float(tau)) not in out:
            out[heldout_split(float(tau))] = float(tau)
    return out


def is_done(path: Path) -> bool:
    return (path / DONE).is_file()


def mark_done(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / DONE).write_text("ok\n")


def registry_model(name: str) -> Path:
    """The HF folder of a registry model (:data:`bebop_megatron.hub.MODELS`): ``$BEBOP_CACHE/NAME/hf``,
    fetched and dequantized when missing."""
    from bebop_megatron import hub

    if name not in hub.MODELS:
        raise StudyError(f"--model {name!r}: not in the registry ({', '.join(hub.MODELS)}); or give --hf-dir")
    spec = hub.MODELS[name]
    cache = hub.cache_root() / spec.name
    hf = cache / "hf"
    if not is_done(hf):
        try:
            hub.dequantize(hub.fetch_gguf(spec, cache, log=log), hf, spec.hf_class, log=log)
        except hub.ModelError as err:
            raise StudyError(str(err)) from None
        mark_done(hf)
    return hf


def model_folder(model: str | None, hf_dir: str | None) -> Path | None:
    """The HF folder of ``--model`` (a registry name) or ``--hf-dir`` (None: neither)."""
    hf = registry_model(model) if model else Path(hf_dir) if hf_dir else None
    if hf is not None and not (hf / "config.json").is_file():
        raise StudyError(f"{hf}: no config.json (not a Hugging Face model folder)")
    return hf


def stage_import(hf: Path, work: Path, *, mtp_num_steps: int = 3) -> Path:
    """``tools/convert_from_hf.py``'s import of ``hf`` into ``work/megatron`` (any family it handles)."""
    from bebop_megatron.convert.importer import convert_from_hf
    from bebop_megatron.platform.checkpoint_writer import failed_writes, filesystem_full, record_write_errors

    meg = work / "megatron"
    if is_done(meg):
        return meg
    shutil.rmtree(meg, ignore_errors=True)
    t0 = time.time()
    log(f"import: {hf} -> {meg}")
    record_write_errors()  # a shard the disk does not take is recorded with its file (Megatron's writer hides it)
    failed_writes.clear()
    try:
        convert_from_hf(str(hf), str(meg), mtp_num_steps=mtp_num_steps, progress=False)
    except BaseException as err:
        disk = write_problem(err) or next((e for e in failed_writes if e.errno in DISK_ERRNOS), None)
        failed_writes.clear()
        if disk is None and not isinstance(err, (KeyboardInterrupt, SystemExit)) and filesystem_full(str(meg)):
            # torch.save's zip writer says a short write as "unexpected pos N vs M" (no OSError)
            disk = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(meg))
        shutil.rmtree(meg, ignore_errors=True)  # incomplete: redone by the next run, its space given back now
        if disk is not None:
            raise write_error(disk, f"import {meg}") from None
        raise
    from bebop_megatron.platform import end_single_process

    end_single_process()  # the import's CPU mode would keep the later CUDA stages on the CPU
    mark_done(meg)
    log(f"import: {time.time() - t0:.0f} s")
    return meg


def write_problem(err: BaseException) -> OSError | None:
    """The disk's failure (no space left, quota, I/O) in ``err`` or the errors it came from
    (causes, contexts, torch's ``CheckpointException.failures``); None: another failure."""
    seen: set = set()
    todo, found = [err], None
    while todo:
        exc = todo.pop()
        if isinstance(exc, TracebackType):
            traceback.clear_frames(exc)
            continue
        if exc is None or id(exc) in seen or not isinstance(exc, BaseException):
            continue
        seen.add(id(exc))
        # Their frames' locals go now, by reference counts: left to the garbage collector, a
        # memoryview of a BytesIO (torch's checkpoint writer's) crashed CPython 3.12 (SIGSEGV).
        traceback.clear_frames(exc.__traceback__)
        if found is None and isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            found = exc
        failures = getattr(exc, "failures", None)
        todo += [exc.__cause__, exc.__context__, *exc.args]
        if isinstance(failures, dict):
            todo += [x for f in failures.values() for x in (f if isinstance(f, tuple) else (f,))]
    return found


def import_sections(hf: Path, mtp_num_steps: int) -> dict:
    """The ``model`` and ``mtp`` sections the import of ``hf`` will write (its ``bebop_model.yaml``),
    from its ``config.json`` alone: the runs' configs are checked with them before the import."""
    from bebop_megatron.convert.hf_config import describe, model_overrides, padded_vocab, read_config
    from bebop_megatron.convert.importer import DEFAULT_MTP_STEPS

    model = describe(read_config(str(hf)))
    num_mtp = model.num_mtp_layers or 1
    steps = mtp_num_steps or (num_mtp if num_mtp > 1 else DEFAULT_MTP_STEPS)
    if num_mtp > 1 and steps != num_mtp:
        raise StudyError(f"--mtp-num-steps {steps}: {hf} has {num_mtp} MTP layers: give --mtp-num-steps {num_mtp}")
    rows = padded_vocab(model.vocab_size, 128, 8)  # convert_from_hf's defaults
    return {"model": model_overrides(model, rows, 128), "mtp": {"num_layers": num_mtp, "num_steps": steps}}


def import_steps(meg: Path) -> int | None:
    """``mtp.num_steps`` of an import's ``bebop_model.yaml`` (None: none there)."""
    from omegaconf import OmegaConf

    path = meg / "bebop_model.yaml"
    if not path.is_file():
        return None
    try:
        return int(OmegaConf.select(OmegaConf.load(path), "mtp.num_steps"))
    except Exception as err:  # a damaged file: the trainer names it when it loads it
        log(f"{path}: cannot read mtp.num_steps ({type(err).__name__})")
        return None


def prompt_sets(prompts: Path, num_train: int, num_heldout: int) -> dict:
    """``{"heldout": [Prompt], "train": [Prompt]}``: a folder's ``heldout.jsonl`` and ``train.jsonl``,
    or one file whose first ``num_heldout`` distinct prompts are held out and the next ``num_train``
    train on. A prompt in both sets is refused (the held-out responses must be new to the head)."""
    from bebop_megatron.data.generate import read_prompts

    if prompts.is_dir():
        missing = [s for s in SPLITS if not (prompts / f"{s}.jsonl").is_file()]
        if missing:
            raise StudyError(f"{prompts}: no {', '.join(m + '.jsonl' for m in missing)} (a prompts folder holds "
                             "train.jsonl and heldout.jsonl; or give one file)")
        sets = {"heldout": read_prompts(str(prompts / "heldout.jsonl"), limit=num_heldout).prompts,
                "train": read_prompts(str(prompts / "train.jsonl"), limit=num_train).prompts}
    elif prompts.is_file():
        every = read_prompts(str(prompts), limit=num_heldout + num_train).prompts
        sets = {"heldout": every[:num_heldout], "train": every[num_heldout:]}
    else:
        raise StudyError(f"--prompts {prompts}: no such file or folder")
    held = {_messages_key(p) for p in sets["heldout"]}
    shared = sum(_messages_key(p) in held for p in sets["train"])
    if shared:
        raise StudyError(f"{shared} train prompts are also held-out prompts: the held-out set must be disjoint")
    if not sets["heldout"] or not sets["train"]:
        raise StudyError(f"--prompts {prompts}: {len(sets['train'])} train and {len(sets['heldout'])} held-out "
                         "prompts; both sets need at least one")
    return sets


def _messages_key(prompt) -> str:
    import json

    return json.dumps(getattr(prompt, "messages", None) or str(prompt.key), sort_keys=True)


def stage_responses(hf: Path, sets: dict, data: Path, *, device: str, seed: int, max_new_tokens: int,
                    batch_size: int, chunk_batches: int = 2, deadline: float | None = None,
                    temperature: float = 1.0, dtype: str = "auto", engine: str = "hf",
                    cuda_graphs: bool = False, heldout_temperatures=()) -> dict:
    """The model's own answers at ``temperature`` to both prompt sets, appended to
    ``data/<split>.jsonl``, and its answers to the held-out prompts at each other temperature of
    ``heldout_temperatures`` (``data/heldout_t0p7.jsonl`` at 0.7: the decode-exact forecast at T is exact
    only on text sampled at T); a killed stage continues where it stopped, and a finished one whose
    folder lacks a temperature's split (made before it was asked for) samples just that split.
    ``engine``: ``hf`` (batched transformers ``generate``) or ``megatron`` (the project's batched
    sampler over the model imported in memory, :mod:`bebop_megatron.speculative.generate_backend`;
    same seeds and sampler, ``cuda_graphs`` on CUDA only). Generation stops at ``deadline``
    (between chunks) once a split has a response. ``dtype``: ``fp32``, ``bf16`` or ``auto`` (bf16 on
    CUDA, fp32 on the CPU)."""
    import json

    from bebop_megatron.data.generate import ExistingOutput, load_existing, plan_jobs, run_generation

    if engine not in ("hf", "megatron"):
        raise StudyError(f"generation engine must be hf or megatron, got {engine!r}")
    splits = {split: temperature if tau is None else tau
              for split, tau in response_splits(heldout_temperatures).items()}
    stats = json.loads((data / "responses.json").read_text()) if is_done(data) else {}
    if is_done(data) and all(split in stats for split in splits):
        return stats
    data.mkdir(parents=True, exist_ok=True)
    backend, backend_tau = None, None
    for index, (split, tau) in enumerate(splits.items()):
        if split in stats:
            continue
        out = data / f"{split}.jsonl"
        existing = load_existing(str(out)) if out.is_file() else None
        done = existing.done if existing else set()
        # train: seed; the held-out text at T=1: seed + 1 (as before); another temperature's: seed + 1 + its index
        offset = 0 if split == "train" else 1 if split == "heldout" else index
        jobs = plan_jobs(sets["heldout" if is_heldout(split) else split], 1, seed + offset, done)
        written, tokens, seconds = len(done), 0, 0.0
        chunk = batch_size * chunk_batches
        for lo in range(0, len(jobs), chunk):
            if deadline is not None and time.time() > deadline and written > 0:
                log(f"responses ({split}): generation budget spent; {len(jobs) - lo} prompts left out")
                break
            if backend is None or backend_tau != tau:
                backend = None
                backend = _backend(engine, hf, max_new_tokens=max_new_tokens, temperature=tau,
                                   batch_size=batch_size, device=device, dtype=dtype, cuda_graphs=cuda_graphs)
                backend_tau = tau
            # Shortest prompts together: less left padding. Sorting within a chunk selects
            # nothing (a chunk is generated whole, the budget is checked between chunks).
            part = sorted(jobs[lo:lo + chunk], key=lambda job: _prompt_length(backend, job))
            summary = run_generation(backend, part, str(out), ExistingOutput(set(), {}), progress=False)
            written += summary.num_written
            tokens += summary.num_tokens
            seconds += summary.seconds
            left = len(jobs) - lo - len(part)
            rate = (lo + len(part)) / max(seconds, 1e-9)
            log(f"responses ({split}): {written} written, {tokens / max(seconds, 1e-9):,.0f} generated tokens/s"
                + (f", {left} left, ETA {left / max(rate, 1e-9):.0f} s" if left else ""))
        if written == 0:
            raise StudyError(f"responses ({split}): none was written (see the lines above)")
        # the sampling temperature: the report labels a decode-exact number at another T approximate
        stats[split] = {"responses": written, "generated_tokens": tokens, "seconds": seconds, "temperature": tau}
    backend = None  # frees the model before training
    if engine == "megatron":  # its in-memory import's process group and CPU mode
        from bebop_megatron.platform import end_single_process

        end_single_process()
    free_cuda()
    (data / "responses.json").write_text(json.dumps(stats) + "\n")
    mark_done(data)
    return stats


def heldout_files(data: Path, stats: dict, temperatures) -> dict[str, Path]:
    """``{T: data/<split>}`` for each evaluation temperature whose own held-out text the responses
    stage sampled besides ``heldout`` (the runs' ``data.valid_files``; its tokenized dataset's prefix);
    a temperature without one is absent."""
    found = {}
    for tau in temperatures:
        split = heldout_split(float(tau))
        if split != "heldout" and split in stats and float(stats[split].get("temperature", 1.0)) == float(tau):
            found[f"{float(tau):g}"] = data / split
    return found


def stage_tokenize(meg: Path, data: Path) -> None:
    """Every response file (:data:`SPLITS` and the other temperatures' held-out splits) as indexed
    datasets (``tools/preprocess_data.py``'s ``preprocess``, with the import's tokenizer), once: every
    trainer then reads them instead of tokenizing the JSONL."""
    from bebop_megatron.data.preprocess import preprocess

    for split in splits_on_file(data):
        src, stamp = data / f"{split}.jsonl", data / f".{split}.tokenized"
        key = f"{src.stat().st_size}\n"
        if stamp.is_file() and stamp.read_text() == key:
            continue
        t0 = time.time()
        try:
            preprocess([str(src)], str(data / split), tokenizer_dir=str(meg / "hf"), train_on="response",
                       on_error="fail", progress=False, overwrite=True)  # the responses changed: tokenized again
        except ValueError as err:  # its DataError; a full disk is the disk's (exit 74)
            disk = write_problem(err)
            if disk is not None:
                raise write_error(disk, f"tokenize {data / split}") from None
            raise
        stamp.write_text(key)
        log(f"tokenize ({split}): {time.time() - t0:.1f} s")


def _backend(engine: str, hf: Path, *, device: str, dtype: str, cuda_graphs: bool, **sampling):
    if engine == "megatron":
        from bebop_megatron.speculative.generate_backend import MegatronBackend

        return MegatronBackend(str(hf), device=device, dtype=dtype, cuda_graphs=cuda_graphs, **sampling)
    from bebop_megatron.data.generate_hf import HFBackend

    return HFBackend(str(hf), device=device, dtype=dtype, **sampling)


def _prompt_length(backend, job) -> int:
    try:
        return len(backend.prompt_ids(job))
    except Exception:  # a template that rejects it: the backend reports it when it generates
        return 0


def free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
