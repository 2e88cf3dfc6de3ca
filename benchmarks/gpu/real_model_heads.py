"""The heads that come back from the GPU study for real speculative decoding here: written on
the GPU machine from the run checkpoints that ``tools/objective_study.py --keep-checkpoints``
keeps (:func:`export_heads`), read here by ``benchmarks/speculative.py --heads`` (:func:`load_head`).

A head file (``head_<condition>_<objective>_seed<S>.pt``, torch.save) holds the MTP block's
weights in bfloat16 (SmolLM2: about 8 MB, under the device tool's 16 MiB per returned file; a
run checkpoint, with its optimizer, is larger) and the run's name, loss and held-out metrics:
``{"run", "loss", "metrics", "mtp": {k: tensor}}``. The backbone stays out: it is the import of
the same GGUF, rebuilt here. ``real_model.sh`` writes them after the study with
``python3 benchmarks/gpu/real_model_heads.py WORK OUT [DEVICE]`` (WORK: the tool's ``--work``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from bebop_megatron.study.log import StudyError, log


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


def score(record: dict) -> float:
    """The held-out E[L](3) RS at T=1 of a run's record (the tool's ``record.json``)."""
    value = record["metrics"]["1"].get("accept_len_rs_g3")
    return -math.inf if value is None else value


def pick_runs(work: Path) -> list[tuple[str, Path, dict]]:
    """``[(run name, folder, record)]``: of the study's last condition (``existing`` when it ran, else
    ``fresh``) and its first seed, the ce run and the other objective's run of the highest
    :func:`score`, among the finished runs in ``work`` (the tool's work folder) that kept their checkpoint."""
    kept = [f for f in sorted((work / "runs").glob("*/*/seed*")) if (f / "record.json").is_file()
            and (f / "ckpt" / "latest").is_file()]
    if not kept:
        return []
    condition = "existing" if any(f.parts[-3] == "existing" for f in kept) else "fresh"
    seed = min(int(f.name[len("seed"):]) for f in kept if f.parts[-3] == condition)
    found = {f.parts[-2]: (f"{condition}_{f.parts[-2]}_seed{seed}", f, json.loads((f / "record.json").read_text()))
             for f in kept if f.parts[-3] == condition and f.name == f"seed{seed}"}
    others = sorted((o for o in found if o != "ce"), key=lambda o: score(found[o][2]), reverse=True)
    return [found[o] for o in (["ce"] if "ce" in found else []) + others[:1]]


def export_heads(work: Path, out: Path, device: str = "cpu") -> list[Path]:
    """``out/head_<run>.pt`` of each run :func:`pick_runs` chooses: its checkpoint loaded with
    ``tools/speculative_generate.py``'s loader (:func:`bebop_megatron.speculative.session.load`),
    its MTP block saved by :func:`save_head`; returns the files written."""
    from bebop_megatron.speculative.session import load
    from bebop_megatron.study.stages import free_cuda

    runs = pick_runs(work)
    if not runs:
        raise StudyError(f"no finished run with a kept checkpoint in {work / 'runs'}: no heads to return")
    written = []
    for name, folder, record in runs:
        model, _ = load(str(folder / "ckpt"), device)  # a ValueError: one error line
        path = out / f"head_{name}.pt"
        save_head(path, model, run=name, loss=record["loss"], metrics=record["metrics"])
        log(f"heads: {path} ({name}, held-out T=1 E[L](3) RS {score(record):.3f})")
        written.append(path)
        del model
        free_cuda()
    return written


if __name__ == "__main__":
    import sys

    from bebop_megatron.cli import run_cli

    if len(sys.argv) not in (3, 4):
        sys.exit("usage: real_model_heads.py WORK OUT [DEVICE]   (WORK: tools/objective_study.py's --work)")
    run_cli(lambda: export_heads(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]))
