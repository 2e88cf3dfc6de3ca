"""What rank 0 reports: console lines, TensorBoard scalars and wandb; other ranks stay silent.

``logging.tensorboard_dir`` turns on TensorBoard (``tensorboard --logdir DIR``);
``logging.metrics_file`` appends the same scalars as JSON lines (for scripts);
``logging.wandb.mode`` is ``online``, ``offline`` (a run directory under
``logging.wandb.dir``/wandb, uploaded later with ``wandb sync``) or ``disabled``.
"""

from __future__ import annotations

import json
import os
import resource

import torch

from bebop_megatron.config import Config
from bebop_megatron.platform.atomic import write_atomic


def peak_memory_gib(device: str) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set on CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(save_dir: str | None) -> str | None:
    """The wandb run id of this training run, kept in ``save_dir``: a requeued or resumed job
    logs into the same wandb run instead of starting a new one. None without ``save.dir``."""
    if not save_dir:
        return None
    path = os.path.join(save_dir, WANDB_ID_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    write_atomic(path, run_id + "\n")
    return run_id


class MonitorError(ValueError):
    """An output that cannot be opened (a directory that cannot be created, a read-only metrics
    file, wandb online without a login): one line naming the field; every rank raises it alike
    (rank 0 broadcasts it)."""

    same_on_every_rank = True


def _cannot_write(field: str, value: str, err: OSError) -> MonitorError:
    return MonitorError(f"{field}={value} cannot be written ({err.strerror or err}: {err.filename or value})")


def _agreed(problem: str | None) -> str | None:
    """Rank 0's problem, on every rank (the other ranks would otherwise wait for it forever)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return problem


class Monitor:
    """Console, TensorBoard and wandb outputs of rank 0 (no-ops elsewhere). Construct it on
    every rank: a problem opening rank 0's outputs is raised on all of them."""

    def __init__(self, cfg: Config, rank: int, print_fn=print):
        self.active = rank == 0
        self.print = print_fn if self.active else (lambda *a, **k: None)
        self.tensorboard = None
        self.wandb_run = None
        self.metrics_file = None
        problem = None
        if self.active:
            try:
                self._open(cfg)
            except ValueError as err:
                problem = str(err)
        problem = _agreed(problem)
        if problem:
            self.close()
            raise MonitorError(problem)

    def _open(self, cfg: Config) -> None:
        log = cfg.logging
        if log.metrics_file:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(log.metrics_file)), exist_ok=True)
                self.metrics_file = open(log.metrics_file, "a")
            except OSError as err:
                raise _cannot_write("logging.metrics_file", log.metrics_file, err) from None
        if log.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "logging.tensorboard_dir is set but tensorboard is not installed: pip install tensorboard"
                ) from None
            try:
                os.makedirs(log.tensorboard_dir, exist_ok=True)
                self.tensorboard = SummaryWriter(log_dir=log.tensorboard_dir)
            except OSError as err:
                raise _cannot_write("logging.tensorboard_dir", log.tensorboard_dir, err) from None
        if log.wandb.mode != "disabled":
            self._open_wandb(cfg)

    def _open_wandb(self, cfg: Config) -> None:
        log = cfg.logging
        try:
            import wandb
        except ImportError:
            raise ValueError(
                f"logging.wandb.mode={log.wandb.mode} needs wandb: pip install -e '.[wandb]'"
            ) from None
        from omegaconf import OmegaConf

        run_dir = log.wandb.dir or cfg.save.dir or "."
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as err:
            raise _cannot_write("logging.wandb.dir" if log.wandb.dir else "save.dir", run_dir, err) from None
        try:
            self.wandb_run = wandb.init(
                project=log.wandb.project,
                name=log.wandb.name,
                mode=log.wandb.mode,
                dir=run_dir,
                config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                id=wandb_run_id(cfg.save.dir),
                resume="allow",
            )
        except wandb.errors.UsageError as err:  # no API key, a bad entity / project, ...
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            hint = ("set WANDB_API_KEY (or run `wandb login`), or use logging.wandb.mode=offline"
                    if log.wandb.mode == "online" else "use logging.wandb.mode=disabled")
            raise MonitorError(f"logging.wandb.mode={log.wandb.mode}: wandb refused to start ({reason}): {hint}") from None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps({"step": step, **values}) + "\n")
            self.metrics_file.flush()
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def text(self, name: str, text: str) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_text(name, f"```\n{text}\n```", 0)

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
            self.metrics_file = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def step_scalars(m, mfu: float | None, peak_mem_gib: float, skipped_total: int) -> dict[str, float]:
    """The per-step numbers logged to TensorBoard / wandb from a ``StepMetrics``."""
    values = {
        "train/loss": m.loss,
        "train/grad_norm": m.grad_norm,
        "train/lr": m.lr,
        "perf/tokens_per_s": m.tokens_per_s,
        "perf/peak_memory_gib": peak_mem_gib,
        "train/skipped_steps": float(skipped_total),
    }
    if mfu is not None:
        values["perf/mfu"] = mfu
    for name, series in (("alpha_rs", m.alpha_rs), ("alpha_to", m.alpha_to), ("top1", m.top1),
                         ("entropy_target", m.entropy_target), ("entropy_draft", m.entropy_draft),
                         ("kl", m.kl), ("accept_len_rs", m.accept_len_rs), ("accept_len_to", m.accept_len_to),
                         ("accept_len_decode_rs", m.accept_len_decode_rs),
                         ("accept_len_decode_to", m.accept_len_decode_to)):
        for k, value in enumerate(series, start=1):
            values[f"mtp/{name}_step{k}"] = value
    return values


def eval_scalars(m) -> dict[str, float]:
    """The held-out pass's numbers: ``eval/loss`` and ``eval/<stat>_step<k>``."""
    values = {"eval/loss": m.loss}
    for name, value in step_scalars(m, None, 0.0, 0).items():
        if name.startswith("mtp/"):
            values["eval/" + name[len("mtp/"):]] = value
    return values
