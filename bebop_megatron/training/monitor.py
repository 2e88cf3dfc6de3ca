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
    os.makedirs(save_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(run_id + "\n")
    os.replace(path + ".tmp", path)
    return run_id


class Monitor:
    """Console, TensorBoard and wandb outputs of rank 0 (no-ops elsewhere)."""

    def __init__(self, cfg: Config, rank: int, print_fn=print):
        self.active = rank == 0
        self.print = print_fn if self.active else (lambda *a, **k: None)
        self.tensorboard = None
        self.wandb_run = None
        self.metrics_file = None
        if not self.active:
            return
        log = cfg.logging
        if log.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(log.metrics_file)), exist_ok=True)
            self.metrics_file = open(log.metrics_file, "a")
        if log.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "logging.tensorboard_dir is set but tensorboard is not installed: pip install tensorboard"
                ) from None
            self.tensorboard = SummaryWriter(log_dir=log.tensorboard_dir)
        if log.wandb.mode != "disabled":
            try:
                import wandb
            except ImportError:
                raise ValueError(
                    f"logging.wandb.mode={log.wandb.mode} needs wandb: pip install -e '.[wandb]'"
                ) from None
            from omegaconf import OmegaConf

            run_dir = log.wandb.dir or cfg.save.dir or "."
            os.makedirs(run_dir, exist_ok=True)
            self.wandb_run = wandb.init(
                project=log.wandb.project,
                name=log.wandb.name,
                mode=log.wandb.mode,
                dir=run_dir,
                config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                id=wandb_run_id(cfg.save.dir),
                resume="allow",
            )

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
