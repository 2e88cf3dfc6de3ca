"""One run of the objective study: its config, its training, its held-out evaluation.

A run trains one objective's MTP head on one seed for a token budget and writes, at once and
atomically, ``record.json`` (settings, timings, the learning curve: the trainer's held-out pass
with the decode-exact E[L]) and ``rows.npz`` (per temperature: the per-position acceptance rows,
the text of every position and the decode-exact sums per text) into its folder; a folder with
``record.json`` is a finished run and is skipped when the study is run again.

The held-out statistics are those of ``tools/eval_acceptance.py``
(:func:`bebop_megatron.evaluate.statistics.micro_batch_statistics`).

With ``ranks`` > 1 (``--ranks N``: tensor parallel N) a run is ``N`` processes of its own, started
with torchrun (:func:`launch_run`, :mod:`bebop_megatron.study.rank`): the training and the
held-out evaluation are collective, rank 0 writes the run's files as one process would, and the
study's process reads them back. The folder is the only channel, so a run killed in either
layout resumes the same way.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bebop_megatron.platform.atomic import atomic_open, write_atomic
from bebop_megatron.study.log import StudyDiskError, StudyError, log, log_file
from bebop_megatron.study.stages import free_cuda

LAUNCH_FILE = "launch.json"  # a run's settings for its processes (ranks > 1)
RANKS_LOG = "ranks.log"  # their stderr (and torchrun's)


@dataclass
class RunConfig:
    """A run's trainer config as the file and the overrides that make it (what its processes
    load again under ``--ranks N``)."""
    file: str
    overrides: list

    def load(self):
        from bebop_megatron.config import load_config

        return load_config(self.file, list(self.overrides))


def train_config(plan, *, loss: str, seed: int, steps: int, lr: float, data_seed: int,
                 init_checkpoint: Path | None, curve_interval: int, folder: Path | None = None) -> RunConfig:
    """The trainer's config of one run. ``plan``: the study's settings (``meg``, the data files,
    sizes, device and precision, ``ranks``: tensor parallel, ``overrides``: the user's extra
    ``KEY=VALUE``). With ``folder``
    the run checkpoints its head at every curve point into ``folder/ckpt`` (MTP weights and
    optimizer: the backbone stays frozen in the import) and continues from there when it was
    killed (``train.resume=auto``), and its held-out passes go to ``folder/metrics.jsonl``."""
    overrides = [
        f"device={plan.device}", f"precision={plan.precision}", "model.transformer_impl=local",
        f"parallel.tensor={getattr(plan, 'ranks', 1)}",
        f"loss.type={loss}", f"loss.chunk_tokens={plan.loss_chunk_tokens}",
        f"data.train_files=[{','.join(str(f) for f in plan.train_files)}]",
        f"data.valid_files=[{','.join(str(f) for f in plan.valid_files)}]",
        f"data.train_on={plan.train_on}", "data.pack=true", f"data.seed={data_seed}",
        f"train.seq_length={plan.seq_length}", f"train.micro_batch_size={plan.micro_batch_size}",
        f"train.global_batch_size={plan.global_batch_size}", f"train.steps={steps}", f"train.lr={lr}",
        "train.lr_schedule=cosine", f"train.min_lr={lr / 10}", f"train.warmup_fraction={plan.warmup_fraction}",
        f"train.seed={seed}", "train.deterministic=false", f"train.log_interval={max(1, steps // 10)}",
        f"eval.interval={curve_interval}", f"eval.max_samples={plan.curve_rows}",
    ]
    if folder is None:
        overrides += ["save.dir=null", "train.resume=none"]
    else:
        overrides += [f"save.dir={folder / 'ckpt'}", f"save.interval={curve_interval}", "save.keep_last=1",
                      "train.resume=auto", f"logging.metrics_file={folder / 'metrics.jsonl'}"]
    if init_checkpoint is not None:  # backbone and MTP weights: an existing head
        overrides += ["model.backbone_checkpoint=null", f"model.init_checkpoint={init_checkpoint}"]
    else:
        overrides += [f"model.backbone_checkpoint={plan.meg}"]
    return RunConfig(str(plan.meg / "bebop_model.yaml"), [*overrides, *plan.overrides])


def held_out_rows(trainer, *, temperatures, gamma: int, chunk_positions: int,
                  micro_batch_size: int, heldout_files: dict | None = None) -> dict:
    """Every held-out row's statistics at each temperature: ``{tau key: {"chain", "alpha_rs",
    "alpha_to", "entropy_target": [K, N], "text": [N], "decode_rs": [n, 2], "decode_to": [n, 2]}}``.
    A temperature of ``heldout_files`` (``{tau key: dataset prefix}``) is evaluated on its own
    text (sampled at it, so its decode-exact forecast is exact); the others on the trainer's held-out
    set (``data.valid_files``).

    ``text`` names the held-out text (a document of a packed row) of every position, numbered
    in the order of :func:`bebop_megatron.chain.decode_exact.per_text_sums` (row by row,
    documents in order), so that ``decode_*`` (accepted drafts and verifications at ``gamma``
    per text) and the positions' texts agree."""
    from bebop_megatron.data.builder import build_valid_dataset, load_tokenizer

    files = {f"{float(k):g}": v for k, v in (heldout_files or {}).items()}
    keys = [f"{float(t):g}" for t in temperatures]
    groups = [([t for t, k in zip(temperatures, keys) if k not in files], trainer.valid_dataset)]
    for t, k in zip(temperatures, keys):
        if k in files:
            cfg = copy.deepcopy(trainer.cfg)
            cfg.data.valid_files = [str(files[k])]
            groups.append(([t], build_valid_dataset(cfg, tokenizer=load_tokenizer(cfg), progress=False,
                                                    log=lambda *_: None)))
    found = {}
    for taus, dataset in groups:
        if taus:
            found.update(_rows_of(trainer, dataset, temperatures=taus, gamma=gamma, chunk_positions=chunk_positions,
                                  micro_batch_size=micro_batch_size))
    return {k: found[k] for k in keys}


def _rows_of(trainer, dataset, *, temperatures, gamma: int, chunk_positions: int, micro_batch_size: int) -> dict:
    """:func:`held_out_rows` of one dataset at ``temperatures``."""
    import torch
    from megatron.core import parallel_state

    from bebop_megatron.data import eval_batches
    from bebop_megatron.evaluate.statistics import micro_batch_statistics
    from bebop_megatron.metrics.report import DECODE_MODES, AcceptanceReport
    from bebop_megatron.chain.masks import chain_valid

    cfg = trainer.cfg
    model = trainer.model.module
    K = cfg.mtp.num_steps
    report = AcceptanceReport(temperatures, K, gamma, [0.0, math.log(cfg.model.vocab_size)], num_scatter=0,
                              keep_positions=True)
    opts = SimpleNamespace(chunk_positions=chunk_positions, sim_trials=0)
    texts: list[np.ndarray] = []
    num_texts = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for micro in eval_batches(dataset, num_rows=len(dataset), global_batch_size=micro_batch_size,
                                  micro_batch_size=micro_batch_size, dp_rank=0, dp_size=1):
            for batch in micro:
                # The text of every position, in the order micro_batch_statistics adds them ([S, B] flattened).
                chain0 = chain_valid(batch.loss_mask, K, batch.segment_ids)[0]  # [B, S]
                seg = batch.segment_ids.numpy()
                index = {}
                for b in range(seg.shape[0]):
                    for d in np.unique(seg[b][chain0[b].numpy() & (seg[b] >= 0)]):
                        index[(b, int(d))] = num_texts + len(index)
                s_idx, b_idx = chain0.t().nonzero(as_tuple=True)
                texts.append(np.asarray([index[(b, int(seg[b, s]))] for s, b in zip(s_idx.tolist(), b_idx.tolist())],
                                        dtype=np.int64))
                num_texts += len(index)
                micro_batch_statistics(model, batch, report, opts, K=K,
                                       tp_group=parallel_state.get_tensor_model_parallel_group(), sim_budget=0,
                                       generator=None, device=trainer._comm_device, vocab_size=cfg.model.vocab_size)
    model.train(was_training)
    text = np.concatenate(texts) if texts else np.zeros(0, dtype=np.int64)
    out = {}
    for ti, (tau, rows) in enumerate(report.position_rows().items()):
        if rows["chain"].shape[1] != len(text):
            raise StudyError(f"held-out rows: {rows['chain'].shape[1]} positions but {len(text)} texts of positions")
        per_text = torch.cat(report.decode[ti]).numpy() if report.decode[ti] else np.zeros((0, len(DECODE_MODES), gamma, 2))
        if per_text.shape[0] != num_texts:
            raise StudyError(f"held-out rows: {per_text.shape[0]} decode-exact texts, {num_texts} texts of positions")
        entry = {k: v.numpy() for k, v in rows.items()}
        entry["text"] = text
        for m, mode in enumerate(DECODE_MODES):
            entry[f"decode_{mode}"] = per_text[:, m, gamma - 1, :]
        out[tau] = entry
    return out


def save_rows(path: Path, rows: dict) -> None:
    arrays = {}
    for tau, entry in rows.items():
        for k, v in entry.items():
            dtype = np.bool_ if k == "chain" else np.int64 if k == "text" else np.float64 if k.startswith("decode") \
                else np.float32
            arrays[f"{tau}|{k}"] = np.asarray(v).astype(dtype)
    with atomic_open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_rows(path: Path) -> dict:
    out: dict = {}
    with np.load(path) as z:
        for key in z.files:
            tau, k = key.split("|", 1)
            out.setdefault(tau, {})[k] = z[key]
    return out


def write_json(path: Path, value) -> None:
    """``value`` as JSON, atomically; a non-finite number (a statistic with nothing to measure) is null."""
    from bebop_megatron.platform.outputs import finite

    write_atomic(path, json.dumps(finite(value), indent=1) + "\n")


def curve_point(m, tokens: int) -> dict:
    return {"tokens": tokens, "step": m.step, "loss": m.loss if tokens else None, "alpha_rs": list(m.alpha_rs),
            "accept_len_rs": list(m.accept_len_rs), "accept_len_decode_rs": list(m.accept_len_decode_rs)}


def curve_of(metrics_file: Path, trainer, tokens_per_step: int, *, K: int) -> list[dict]:
    """The held-out passes of the run: from ``metrics_file`` when the run wrote one (it survives a
    kill and a resume; the last line of a step wins), else the trainer's ``eval_history``."""
    if not metrics_file.is_file():
        return [curve_point(m, m.step * tokens_per_step) for m in trainer.eval_history]
    by_step = {}
    for line in metrics_file.read_text().splitlines():
        try:
            values = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if "eval/loss" not in values:
            continue
        step = int(values["step"])

        def series(name):
            return [values[f"eval/{name}_step{k}"] for k in range(1, K + 1) if f"eval/{name}_step{k}" in values]

        by_step[step] = {"tokens": step * tokens_per_step, "step": step, "loss": values["eval/loss"],
                         "alpha_rs": series("alpha_rs"), "accept_len_rs": series("accept_len_rs"),
                         "accept_len_decode_rs": series("accept_len_decode_rs")}
    return [by_step[s] for s in sorted(by_step)]


def run_one(folder: Path, run: RunConfig, *, temperatures, gamma: int, chunk_positions: int,
            heldout_files: dict | None = None,
            save_head: Path | None = None, verbose: bool = False, meta: dict | None = None, ranks: int = 1,
            keep_checkpoint: bool = False) -> dict:
    """Train one run, evaluate it, write its folder (``record.json`` last); returns its record.
    ``ranks`` > 1: in that many processes of its own (:func:`launch_run`), else in this one."""
    kwargs = dict(temperatures=temperatures, gamma=gamma, chunk_positions=chunk_positions,
                  heldout_files={k: str(v) for k, v in (heldout_files or {}).items()}, save_head=save_head,
                  verbose=verbose, meta=meta, keep_checkpoint=keep_checkpoint)
    if ranks > 1:
        return launch_run(folder, run, ranks=ranks, **kwargs)
    return train_and_evaluate(folder, run.load(), **kwargs)


def launch_run(folder: Path, run: RunConfig, *, ranks: int, temperatures, gamma: int,
               heldout_files: dict | None = None,
               chunk_positions: int, save_head: Path | None, verbose: bool, meta: dict | None,
               keep_checkpoint: bool = False) -> dict:
    """The run in ``ranks`` processes (torchrun, ``--standalone``): its settings go to
    ``folder/launch.json``, each process runs :mod:`bebop_megatron.study.rank` on it (the same
    :func:`train_and_evaluate`, collective), rank 0's lines come to this process's stdout and the
    study's log, every process's stderr to ``folder/ranks.log``; the record is read back from the
    folder. A failure is one line: the processes' ``error:`` line, or their exit status and the
    log to read."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"folder": str(folder), "config_file": run.file, "overrides": list(run.overrides),
            "temperatures": list(temperatures), "gamma": gamma, "chunk_positions": chunk_positions,
            "heldout_files": {k: str(v) for k, v in (heldout_files or {}).items()},
            "save_head": None if save_head is None else str(save_head), "verbose": verbose, "meta": meta,
            "keep_checkpoint": keep_checkpoint,
            "log_file": None if log_file() is None else str(log_file())}
    write_json(folder / LAUNCH_FILE, spec)
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    # torchrun would set 1 thread per process (with a warning): share the cores out instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "bebop_megatron.study.rank", str(folder / LAUNCH_FILE)]
    with open(folder / RANKS_LOG, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=None, stderr=err)
        code, stopped_by = _wait_forwarding_signals(proc)
    if stopped_by is not None:  # the study was interrupted: its processes stopped as on preemption
        log(f"{folder}: the run's {ranks} processes stopped (signal {stopped_by}); run the study again to continue")
        if stopped_by == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + stopped_by)
    if code != 0 or not is_finished(folder):
        lines = (folder / RANKS_LOG).read_text(errors="replace").splitlines()
        said = [line for line in lines if line.startswith("error: ")]
        if code == StudyDiskError.exit_code and said:  # the trainer's: a checkpoint the disk did not take
            raise StudyDiskError(f"{folder}: the run's {ranks} processes stopped: {said[0][len('error: '):]}")
        raise StudyError(f"{folder}: the run's {ranks} processes " + (f"stopped: {said[0][len('error: '):]}" if said
                         else f"ended with exit status {code}" + ("" if code else " without its record")
                         + f"; their output: {folder / RANKS_LOG}"))
    return read_record(folder)


def _wait_forwarding_signals(proc: subprocess.Popen) -> tuple[int, int | None]:
    """Wait for torchrun; a SIGINT or SIGTERM of this process goes to it as SIGTERM (its ranks
    were started in sessions of their own, so a terminal's Ctrl-C does not reach them): they
    checkpoint and stop as on preemption. ``(exit status, the signal received or None)``."""
    import signal as signals

    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        if proc.poll() is None:
            proc.send_signal(signals.SIGTERM)

    previous = {sig: signals.signal(sig, forward) for sig in (signals.SIGINT, signals.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signals.signal(sig, handler)
    return code, (received[0] if received else None)


def train_and_evaluate(folder: Path, cfg, *, temperatures, gamma: int, chunk_positions: int,
                       heldout_files: dict | None = None,
                       save_head: Path | None = None, verbose: bool = False, meta: dict | None = None,
                       keep_checkpoint: bool = False) -> dict:
    """The run itself, in this process, alone or as one rank of the run's processes: the trainer,
    the training, the held-out evaluation and the head are collective; rank 0 writes the files."""
    import torch
    import torch.distributed as dist

    from bebop_megatron.training import Trainer
    from bebop_megatron.training.model_weights import save_model_checkpoint

    from bebop_megatron.study.intervals import point_metrics

    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    trainer = Trainer(cfg, log=(lambda *a, **k: print(*a, **k)) if verbose else (lambda *a, **k: None))
    writer = not dist.is_initialized() or dist.get_rank() == 0
    build_s = time.time() - t0
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_length
    start_file = folder / "start.json"
    # Every rank reads start.json before the first collective below: rank 0 cannot have written it yet.
    if start_file.is_file():  # a killed run continues: its head's first point was measured before
        start = json.loads(start_file.read_text())
        has_ckpt = (folder / "ckpt" / "latest").exists() or any((folder / "ckpt").glob("iter_*"))
        log(f"{folder}: continuing a killed run " + ("from its last checkpoint" if has_ckpt else
                                                      "from its start (it had no checkpoint yet)"))
    else:
        start = curve_point(trainer.evaluate_valid(), 0)  # the curve's first point: the head as it starts
        if writer:
            write_json(start_file, start)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t1 = time.time()
    history = trainer.train()
    train_s = time.time() - t1
    t2 = time.time()
    rows = held_out_rows(trainer, temperatures=temperatures, gamma=gamma, chunk_positions=chunk_positions,
                         micro_batch_size=cfg.train.micro_batch_size, heldout_files=heldout_files)
    eval_s = time.time() - t2
    if save_head is not None:
        save_model_checkpoint(str(save_head), trainer.model)
    if writer:
        timed = [m.tokens_per_s for m in history[1:]] or [m.tokens_per_s for m in history] or [float("nan")]
        record = {
            **(meta or {}), "loss": cfg.loss.type, "steps": cfg.train.steps, "lr": cfg.train.lr,
            "tokens": cfg.train.steps * tokens_per_step, "tokens_per_s": statistics.median(timed),
            "build_s": build_s, "train_s": train_s, "eval_s": eval_s,
            "final_train_loss": history[-1].loss if history else None, "ranks": cfg.parallel.tensor,
            "curve": [start] + curve_of(folder / "metrics.jsonl", trainer, tokens_per_step, K=cfg.mtp.num_steps),
            "metrics": {tau: point_metrics(r, gamma) for tau, r in rows.items()},
            # the temperatures evaluated on held-out text sampled at them (the others: on data.valid_files)
            "own_text_temperatures": sorted(f"{float(k):g}" for k in (heldout_files or {})),
        }
        save_rows(folder / "rows.npz", rows)
        write_json(folder / "record.json", record)
    if dist.is_initialized():
        dist.barrier()  # every rank is past its last use of the checkpoints before they go
    if writer and not keep_checkpoint:
        shutil.rmtree(folder / "ckpt", ignore_errors=True)  # finished: its checkpoints are no longer needed
    del trainer
    free_cuda()
    return read_record(folder)


def is_finished(folder: Path) -> bool:
    return (folder / "record.json").is_file() and (folder / "rows.npz").is_file()


def read_record(folder: Path) -> dict:
    return json.loads((folder / "record.json").read_text())
