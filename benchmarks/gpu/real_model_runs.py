"""The GPU study's bookkeeping: what every run writes to ``--out`` (:class:`Results`), how many
steps fit the time left (:func:`plan_steps`, :func:`fit_objectives`) and the trained heads that
come back for real speculative decoding here (:class:`HeadKeeper`, :func:`load_head`).

A head file (``head_<run>.pt``, torch.save) holds the MTP block's weights in bfloat16 (SmolLM2:
about 8 MB, under the device tool's 16 MiB per returned file) and what rebuilds the model
around them: ``{"run", "loss", "metrics", "mtp": {k: tensor}}``. The backbone stays out: it is
the import of the same GGUF, rebuilt here (``benchmarks/gpu/real_model_speculative.py``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from real_model_files import StudyError

class Results:
    """Everything a run produces, rewritten to ``--out`` after every run (a killed study keeps
    what finished): ``summary.json``, ``positions_<condition>.npz`` (float16 rows)."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta = out, meta
        self.runs: dict[str, dict] = {}
        self.rows: dict[str, dict] = {}

    def add(self, name: str, record: dict, rows: dict) -> None:
        self.runs[name] = record
        self.rows[name] = rows
        self.write()

    def write(self) -> None:
        import numpy as np

        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps({**self.meta, "runs": self.runs}, indent=1) + "\n")
        os.replace(tmp, self.out / "summary.json")
        for condition in ("fresh", "finetune"):
            arrays = {}
            for name, per_t in self.rows.items():
                if not name.startswith(condition + "_"):
                    continue
                for tau, rows in per_t.items():
                    for k, v in rows.items():
                        dtype = np.bool_ if k == "chain" else np.float16
                        arrays[f"{name}|{tau}|{k}"] = v.astype(dtype)
            if arrays:
                with open(self.out / f"positions_{condition}.npz.tmp", "wb") as f:
                    np.savez_compressed(f, **arrays)
                os.replace(self.out / f"positions_{condition}.npz.tmp", self.out / f"positions_{condition}.npz")


def plan_steps(*, left_s: float, num_runs: int, step_s: float, fixed_s: float, tokens_per_step: int,
               target_tokens: int, min_steps: int) -> int:
    """Steps per run so that ``num_runs`` runs fit ``left_s`` (each: ``fixed_s`` plus its steps),
    at most the steps of ``target_tokens``; at least ``min_steps``, or a :class:`StudyError`."""
    fits = int((left_s - num_runs * fixed_s) / (num_runs * step_s)) if step_s > 0 else 0
    steps = min(fits, math.ceil(target_tokens / tokens_per_step))
    if steps < min_steps:
        raise StudyError(f"only {fits} steps per run fit the time left ({left_s:.0f} s for {num_runs} runs of "
                         f"{step_s:.2f} s per step + {fixed_s:.0f} s each): raise --budget-s or run fewer objectives")
    return steps


def fit_objectives(objectives: list[str], **plan) -> tuple[int, list[str], list[str]]:
    """``(steps, kept, dropped)``: the objectives that fit in both conditions at ``plan_steps``'
    terms, dropping the last ones first (``ce``, the reference, stays with at least one other)."""
    kept = list(objectives)
    while True:
        try:
            return plan_steps(num_runs=2 * len(kept), **plan), kept, objectives[len(kept):]
        except StudyError:
            if len(kept) <= 2:
                raise
            kept.pop()


def mtp_block(model):
    """The MTP block of a (possibly wrapped: DDP, Float16Module) Megatron model."""
    seen = model
    while not hasattr(seen, "mtp") and hasattr(seen, "module"):
        seen = seen.module
    if getattr(seen, "mtp", None) is None:
        raise StudyError("the model has no MTP block")
    return seen.mtp


def save_head(path: Path, model, *, run: str, loss: str, metrics: dict) -> None:
    """The MTP block's weights (bfloat16, on the CPU) and the run's name and held-out metrics."""
    import torch

    state = {k: v.detach().to("cpu", torch.bfloat16) if v.is_floating_point() else v.detach().cpu()
             for k, v in mtp_block(model).state_dict().items() if v is not None and torch.is_tensor(v)}
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"run": run, "loss": loss, "metrics": metrics, "mtp": state}, tmp)
    os.replace(tmp, path)


def load_head(path: Path, model) -> dict:
    """Load a head file's weights into ``model``'s MTP block (strict: the same MTP layout, or a
    :class:`StudyError` naming the keys); returns the file's record without the weights."""
    import torch

    record = torch.load(path, map_location="cpu", weights_only=True)
    block = mtp_block(model)
    own = block.state_dict()
    state = {k: v.to(own[k].dtype) if k in own and torch.is_tensor(own[k]) else v for k, v in record["mtp"].items()}
    missing, unexpected = set(own) - set(state), set(state) - set(own)
    missing = {k for k in missing if not k.endswith("_extra_state")}
    if missing or unexpected:
        raise StudyError(f"{path}: the head does not fit this model's MTP block (missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}): same model and --mtp-num-steps?")
    block.load_state_dict(state, strict=False)
    return {k: v for k, v in record.items() if k != "mtp"}


class HeadKeeper:
    """The heads that come back from the GPU: ``head_<ce_run>.pt`` (the ce reference) and
    ``head_best.pt`` (the run of the highest held-out E[L](3) RS at T=1 among the others of its
    condition), rewritten in ``out`` as soon as a run improves on it, so a study stopped early
    still returns the best head so far."""

    def __init__(self, out: Path, condition: str = "finetune"):
        self.out, self.condition, self.best = out, condition, -math.inf

    @staticmethod
    def score(metrics: dict) -> float:
        return metrics["1"]["accept_len_rs_g3"]

    def consider(self, name: str, model, record: dict) -> str | None:
        """Save the run's head when it is kept; returns the file name written (or None)."""
        condition, loss = name.split("_", 1)
        if condition != self.condition:
            return None
        if loss == "ce":
            target = self.out / f"head_{name}.pt"
        elif self.score(record["metrics"]) > self.best:
            self.best, target = self.score(record["metrics"]), self.out / "head_best.pt"
        else:
            return None
        save_head(target, model, run=name, loss=loss, metrics=record["metrics"])
        return target.name
