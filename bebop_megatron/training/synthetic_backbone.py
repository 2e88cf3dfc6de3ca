"""A backbone with real structure for the quick start: fitted to the synthetic language, cached.

A randomly initialised backbone predicts an almost uniform p (H(p) ~ ln V), so its draft
heads' acceptance says nothing about the method. With ``model.backbone_init=fit_synthetic``
(the embedded quick-start default) and synthetic data, the backbone is first fitted to the
synthetic Markov language (next-token cross-entropy, all backbone weights, Adam) in one CPU
process at TP=1, saved as a Megatron distributed checkpoint and used as
``model.backbone_checkpoint`` (it loads at any layout). Its p then has the language's
state-dependent entropy, as a real model's does.

The checkpoint is cached outside the repository, in
``$BEBOP_MEGATRON_CACHE`` (default ``~/.cache/bebop_megatron``)``/synthetic_backbone/<key>``,
where ``<key>`` hashes everything that defines the fitted weights (:func:`fit_key`: the model
shape, the synthetic language, the fit recipe and :data:`FIT_VERSION`); a missing entry is
rebuilt, a changed config gets its own entry. The fit is deterministic (fixed seed, data
order and thread count) and runs in a child process (``python -m
bebop_megatron.training.synthetic_backbone CONFIG.yaml OUT``) so that it never touches the
run's process groups; the other ranks wait for rank 0's outcome. A damaged entry (a truncated
file) is rebuilt; a cache that cannot be written (read-only, full) is one :class:`CacheError`
line naming it, and an interrupted fit (Ctrl-C, SIGTERM, SIGHUP) leaves no ``<key>.tmp<PID>`` behind.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

FIT_VERSION = 1
"""Bump when the fit recipe or the saved format changes: old cache entries are then ignored."""
FIT_STEPS = 100
FIT_BATCH = 16  # sequences of train.seq_length per step
FIT_LR = 5e-3
FIT_WARMUP = 10
FIT_SEED = 4321
FIT_THREADS = 1  # fixed, so that the float sums (and the cached weights) do not depend on the machine
DONE = "fit.json"  # written last: an entry without it is incomplete
_NOT_IN_KEY = ("backbone_checkpoint", "init_checkpoint", "transformer_impl", "attention_backend", "freeze_backbone",
               "backbone_init")
WRITE_FAILED = 74  # the fit's exit status when its checkpoint could not be written (EX_IOERR)
_HINT = "set BEBOP_MEGATRON_CACHE to a writable directory with space, or use model.backbone_init=random"


class CacheError(ValueError):
    """The synthetic-backbone cache cannot be written (read-only, full); one line naming it.
    Every rank raises it alike (rank 0 broadcasts it)."""

    same_on_every_rank = True


def cache_root() -> str:
    return os.environ.get("BEBOP_MEGATRON_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "bebop_megatron")


def fit_key(cfg) -> dict:
    """What defines the fitted weights (hashed into the cache path)."""
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in _NOT_IN_KEY}
    data = {k: getattr(cfg.data, k) for k in ("num_samples", "markov_branching", "markov_min_branching", "seed")}
    recipe = {"steps": FIT_STEPS, "batch": FIT_BATCH, "lr": FIT_LR, "warmup": FIT_WARMUP, "seed": FIT_SEED,
              "threads": FIT_THREADS}
    return {"version": FIT_VERSION, "model": model, "data": data, "seq_length": cfg.train.seq_length, "fit": recipe}


def cache_path(cfg) -> str:
    digest = hashlib.sha256(json.dumps(fit_key(cfg), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "synthetic_backbone", digest)


def _padded(cfg) -> int:
    """The run's padded vocabulary (``model.builder.padded_vocab_size``, without importing Megatron)."""
    if cfg.model.padded_vocab_size:
        return cfg.model.padded_vocab_size
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor
    return -(-cfg.model.vocab_size // multiple) * multiple


def applies(cfg) -> bool:
    """``fit_synthetic`` on synthetic data without another backbone (a config already resolved
    to this cache entry, as a saved one is, still applies: a deleted entry is rebuilt)."""
    m = cfg.model
    if m.backbone_init != "fit_synthetic" or cfg.data.train_files or m.init_checkpoint:
        return False
    resolved = copy.deepcopy(cfg)
    resolved.model.padded_vocab_size = _padded(cfg)
    return m.backbone_checkpoint in (None, cache_path(resolved))


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DONE))


def entry_problem(path: str) -> str | None:
    """What is wrong with a complete entry's files (a truncated one failed to load with an
    ``EOFError`` after the model build), or None."""
    from bebop_megatron.training.resume import files_problem

    try:
        with open(os.path.join(path, DONE)) as f:
            if not isinstance(json.load(f), dict):
                raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        return f"{DONE} is unreadable or truncated ({type(err).__name__})"
    return files_problem(path)


def _not_writable(err: OSError) -> CacheError:
    where = err.filename or cache_root()
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        return CacheError(f"synthetic-backbone cache: {what} while writing {where}; {_HINT}")
    return CacheError(f"synthetic-backbone cache {cache_root()} cannot be written ({err.strerror or err}: {where}); "
                      f"{_HINT}")


def resolve(cfg) -> str | None:
    """Point ``cfg.model.backbone_checkpoint`` at the cache entry (nothing is fitted); None when
    not applicable."""
    if not applies(cfg):
        return None
    # The fitted embedding and output layer have the run's padded rows; recorded in the config, so
    # that the run, its resume and tools/eval_acceptance.py (at any TP dividing it) load them.
    cfg.model.padded_vocab_size = _padded(cfg)
    cfg.model.backbone_checkpoint = cache_path(cfg)
    return cfg.model.backbone_checkpoint


def prepare(cfg, rank: int = 0, log=print) -> str | None:
    """Point ``cfg.model.backbone_checkpoint`` at the fitted backbone and fit it if it is missing
    (rank 0, in a child process; every rank waits). Returns the path, or None when not applicable.
    Call after ``init_distributed`` (it uses a barrier when a process group exists)."""
    import torch.distributed as dist

    path = resolve(cfg)
    if path is None:
        return None
    problem, unexpected = None, None
    if rank == 0:
        try:
            damaged = entry_problem(path) if is_complete(path) else None
            if damaged:
                log(f"backbone: the cached entry {path} is damaged ({damaged}): fitting it again")
                shutil.rmtree(path, ignore_errors=True)
            if is_complete(path):
                log(f"backbone: fitted to the synthetic language, cached in {path}")
            else:
                run_fit(cfg, path, log)
        except CacheError as err:
            problem = str(err)
        except Exception as err:  # the other ranks must not wait for rank 0 forever
            problem, unexpected = f"rank 0 failed while fitting the synthetic backbone ({type(err).__name__})", err
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)  # also the barrier: every rank waits for the fit
        problem = box[0]
    if unexpected is not None:
        raise unexpected
    if problem:
        raise CacheError(problem)
    return path


def run_fit(cfg, path: str, log=print) -> dict:
    """Fit in a child process (one CPU process at TP=1) into ``path``; returns its ``fit.json``."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with _stopping_signals_raise():
            return _fit_into(cfg, path, tmp, log)
    finally:  # a failed or interrupted (Ctrl-C, SIGTERM) fit leaves nothing; after the rename tmp is gone
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _stopping_signals_raise():
    """SIGTERM / SIGHUP (``timeout``, ``scancel``, a closed terminal) stop the fit as Ctrl-C does,
    with ``SystemExit(128 + signal)``: the default action killed the process before its
    ``finally`` removed ``<key>.tmp<PID>`` (the child is killed by ``subprocess.run``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _fit_into(cfg, path: str, tmp: str, log) -> dict:
    from bebop_megatron.config import to_yaml

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with open(os.path.join(tmp, "run_config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
    except OSError as err:  # read-only or full cache
        raise _not_writable(err) from None
    # A world of its own: none of torchrun's variables (TORCHELASTIC_USE_AGENT_STORE would make it
    # wait for the launcher's store).
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_") and k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")}
    env["OMP_NUM_THREADS"] = str(FIT_THREADS)
    log(f"backbone: fitting a {cfg.model.num_layers}-layer backbone to the synthetic language "
        f"({FIT_STEPS} steps, once; cached in {path})")
    proc = subprocess.run([sys.executable, "-m", "bebop_megatron.training.synthetic_backbone",
                           os.path.join(tmp, "run_config.yaml"), tmp],
                          env=env, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not is_complete(tmp):
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
        if proc.returncode == WRITE_FAILED:  # the child's one line: "error: no space left on device while ..."
            raise CacheError(f"synthetic-backbone cache: {tail.removeprefix('error: ')}; {_HINT}")
        raise RuntimeError(f"fitting the synthetic backbone failed: {tail}")
    try:
        os.rename(tmp, path)
    except OSError:  # another run published the same (deterministic) entry first
        pass
    with open(os.path.join(path, DONE)) as f:
        return json.load(f)


def fit(cfg, out: str, log=print) -> dict:
    """Fit the backbone of ``cfg``'s shape to its synthetic language and save it to ``out``.

    Runs in a fresh process: builds Megatron's parallel state at TP=1 (one gloo rank)."""
    import numpy as np
    import torch

    from bebop_megatron.config import load_config, to_yaml
    from bebop_megatron.data import build_train_dataset, make_batch
    from bebop_megatron.losses.vocab import mask_padded_vocab_
    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.platform.checkpoint_writer import record_write_errors
    from bebop_megatron.platform.lazy_imports import use_deterministic_algorithms
    from bebop_megatron.training.model_weights import save_model_checkpoint
    from bebop_megatron.training.parallel import setup_parallel

    torch.set_num_threads(FIT_THREADS)
    use_deterministic_algorithms(warn_only=True)
    fit_cfg = load_config(None, [
        # The attention the fit has always used: the cached weights do not depend on the run's backend.
        "device=cpu", "precision=fp32", "model.transformer_impl=local", "model.attention_backend=unfused",
        "model.freeze_backbone=false",
        "model.backbone_checkpoint=null", "model.init_checkpoint=null", "mtp.num_layers=1", "mtp.num_steps=1",
        "parallel.tensor=1", "parallel.pipeline=1", "parallel.pipeline_layout=null", "parallel.expert=1",
        "parallel.expert_tensor=null", "parallel.context=1", "parallel.sequence_parallel=false",
        f"train.seed={FIT_SEED}", "train.resume=none", "save.dir=null", "data.valid_files=[]",
    ], defaults=_container(to_yaml(cfg)))
    init_distributed("cpu")  # a process group of one (gloo)
    setup_parallel(fit_cfg, 1)
    model = build_model(fit_cfg, "cpu")
    model.train()
    model.mtp_process = False  # the backbone alone: the forward returns its final hidden state
    params = [p for n, p in model.named_parameters() if not n.startswith("mtp.")]
    optimizer = torch.optim.Adam(params, lr=FIT_LR, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / FIT_WARMUP) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, FIT_STEPS) / FIT_STEPS))))
    dataset = build_train_dataset(fit_cfg)
    order = np.random.default_rng(FIT_SEED).permutation(len(dataset))
    vocab = fit_cfg.model.vocab_size
    entropy = dataset.entropy_rate()
    log(f"backbone fit: target = the language's entropy rate {entropy:.3f} nats/token (ln V = {math.log(vocab):.3f})")
    losses, start = [], time.perf_counter()
    for step in range(FIT_STEPS):
        ids = [int(order[(step * FIT_BATCH + i) % len(order)]) for i in range(FIT_BATCH)]
        batch = make_batch(dataset, ids)
        S = batch.tokens.shape[1]
        hidden_SBH = model(batch.tokens, batch.position_ids.expand(batch.tokens.shape[0], S), None)
        logits_SBV, _ = model.output_layer(hidden_SBH, weight=model.output_weight())
        logits_SBV = mask_padded_vocab_(logits_SBV.float(), vocab, None)
        loss = torch.nn.functional.cross_entropy(logits_SBV.flatten(0, 1), batch.labels.t().flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss))
        if (step + 1) % (FIT_STEPS // 4) == 0 or step == 0:
            log(f"backbone fit: step {step + 1:>4}/{FIT_STEPS} | loss {losses[-1]:.3f} (entropy rate {entropy:.3f}) "
                f"| {time.perf_counter() - start:.0f}s")
    model.mtp_process = True
    record_write_errors()  # a failed shard write keeps its OSError (and file) for the error line
    save_model_checkpoint(out, model)
    record = {"key": fit_key(cfg), "final_loss": float(np.mean(losses[-20:])), "first_loss": losses[0],
              "entropy_rate": entropy, "ln_vocab": math.log(vocab), "seconds": time.perf_counter() - start,
              "cpu_seconds": time.process_time(), "losses": losses}
    with open(os.path.join(out, DONE), "w") as f:
        json.dump(record, f, indent=1)
    return record


def _container(yaml_text: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(yaml_text))


def main(argv=None) -> None:
    config_file, out = (argv if argv is not None else sys.argv[1:])
    with open(config_file) as f:
        from bebop_megatron.config import load_config

        cfg = load_config(None, defaults=_container(f.read()))
    try:
        fit(cfg, out, log=lambda line: print(line, flush=True))
    except BaseException as err:  # torch's CheckpointException is a BaseException
        from bebop_megatron.training.write_errors import write_problem

        problem = write_problem(err, out) if not isinstance(err, (KeyboardInterrupt, SystemExit)) else None
        if problem is None:
            raise
        print(f"error: {problem}", file=sys.stderr, flush=True)  # e.g. no space left on device while writing ...
        sys.exit(WRITE_FAILED)


if __name__ == "__main__":
    main()
