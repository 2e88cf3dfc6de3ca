"""The objective study: every (condition, seed, objective) run, resumable, then the report.

Order: condition by condition, seed by seed, ``ce`` first among the objectives. Per seed every
objective starts from the same initialisation (``train.seed``) and reads the same data in the
same order (``data.seed``): the runs of one seed differ only in their loss.

Conditions:

- ``fresh``: new MTP layers (``mtp.init``'s default) on the imported backbone, ``lr``;
- ``existing``: a head that exists before the objective's run, continued at ``ft_lr`` with
  another data order (``data.seed`` = seed + 1): ``import`` (the import's own MTP layers,
  ``model.init_checkpoint`` = the import) or ``ce:N`` (per seed, a fresh head first trained
  with ce for N tokens, saved once in ``WORK/heads/`` and shared by every objective; when N
  gives the runs' steps, the fresh condition's ce run is that head: :func:`shares_fresh_ce`).

Every run's folder is ``WORK/runs/<condition>/<objective>/seed<S>/``; a finished one is skipped,
so a killed study re-run with the same command continues with the first unfinished run, from
that run's last checkpoint (:func:`bebop_megatron.study.runs.train_config`). With ``ranks`` > 1
every run is that many processes (tensor parallel), started per run; they hand the run's files
back in its folder (:func:`bebop_megatron.study.runs.launch_run`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from bebop_megatron.study.log import StudyError, log
from bebop_megatron.study.runs import RunConfig, is_finished, read_record, run_one, train_config
from bebop_megatron.study.stages import is_done, mark_done

CONDITIONS = ("fresh", "existing")
TEMPERATURES = (1.0, 0.7)
GAMMA = 3


@dataclass
class StudyPlan:
    work: Path
    out: Path
    meg: Path
    train_files: list
    valid_files: list
    objectives: list
    conditions: list = field(default_factory=lambda: ["fresh"])
    existing: str = "ce:0"  # "import" or "ce:N"
    seeds: list = field(default_factory=lambda: [0])
    tokens: int = 40_000
    lr: float = 1e-3
    ft_lr: float = 1e-4
    train_on: str = "response"
    seq_length: int = 1024
    micro_batch_size: int = 4
    global_batch_size: int = 8
    warmup_fraction: float = 0.05
    curve_points: int = 8
    curve_rows: int = 64
    loss_chunk_tokens: int = 8192
    chunk_positions: int = 4096
    device: str = "cpu"
    precision: str = "fp32"
    ranks: int = 1  # processes per run: tensor parallel (runs.launch_run when > 1)
    keep_checkpoints: bool = False  # a finished run keeps RUN/ckpt (its last training checkpoint)
    overrides: list = field(default_factory=list)
    temperatures: tuple = TEMPERATURES
    heldout_files: dict = field(default_factory=dict)  # {T: the held-out text sampled at T}; else valid_files
    gamma: int = GAMMA
    verbose: bool = False
    title: str = ""
    info: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_length

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.tokens / self.tokens_per_step))


def check_plan(plan: StudyPlan) -> None:
    bad = [c for c in plan.conditions if c not in CONDITIONS]
    if bad:
        raise StudyError(f"unknown condition {bad[0]!r}: choose from {', '.join(CONDITIONS)}")
    if len(set(plan.objectives)) != len(plan.objectives) or not plan.objectives:
        raise StudyError(f"--objectives must name distinct objectives, got {plan.objectives}")
    if "existing" in plan.conditions:
        parse_existing(plan.existing)
    if len(set(plan.seeds)) != len(plan.seeds) or not plan.seeds:
        raise StudyError(f"--seeds must be distinct integers, got {plan.seeds}")
    check_seeds(plan.seeds)
    if plan.tokens < 1:
        raise StudyError(f"--tokens must be at least 1, got {plan.tokens}")
    if plan.ranks < 1:
        raise StudyError(f"--ranks must be at least 1, got {plan.ranks}")


SEED_MAX = 2**32 - 2  # numpy's seeds end at 2**32 - 1, and the existing condition reads data with seed + 1


def check_seeds(seeds, flag: str = "--seeds") -> None:
    bad = [s for s in seeds if not 0 <= s <= SEED_MAX]
    if bad:
        raise StudyError(f"{flag}: {bad[0]} is out of range; seeds are integers from 0 to {SEED_MAX}")


def check_flags(plan: StudyPlan) -> None:
    """What needs neither the model nor a config: the objectives are loss types, the seeds numpy's,
    the device exists (before a registry model is fetched)."""
    from bebop_megatron.config.loader import LOSS_TYPES

    bad = [o for o in plan.objectives if o not in LOSS_TYPES]
    if bad:
        raise StudyError(f"--objectives: unknown objective {bad[0]!r} (loss types: {', '.join(LOSS_TYPES)})")
    check_seeds(plan.seeds)
    if plan.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise StudyError("--device cuda: no CUDA device is visible here; use --device cpu")


def check_configs(plan: StudyPlan, *, sections: dict | None = None) -> None:
    """Before any work (the import, the responses, the first run): the objectives are loss types,
    the device exists, and every run's trainer config (each objective; the existing condition;
    its ce head) loads and validates with the study's sizes, ``--set`` overrides and precision,
    at ``plan.ranks``. The model's sections come from ``plan.meg``'s ``bebop_model.yaml`` when
    the import is there, else from ``sections`` (:func:`bebop_megatron.study.stages.import_sections`:
    what the import will write). The data files are checked when given (``plan.train_files``)."""
    from bebop_megatron.config import ConfigError, load_config, parallel_sizes

    check_flags(plan)
    file = plan.meg / "bebop_model.yaml"
    if not file.is_file() and sections is None:
        raise StudyError(f"{plan.meg}: no bebop_model.yaml (not an import of tools/convert_from_hf.py)")
    fresh = "fresh" in plan.conditions
    kind = parse_existing(plan.existing) if "existing" in plan.conditions else None
    init = None if kind is None else plan.meg if kind == "import" else plan.work / "heads" / "check"
    runs = [dict(loss=o, seed=plan.seeds[0], lr=plan.lr if fresh else plan.ft_lr, data_seed=0,
                 init_checkpoint=None if fresh else init) for o in plan.objectives]
    if kind is not None:
        runs.append(dict(loss=plan.objectives[0], seed=plan.seeds[0], lr=plan.ft_lr, data_seed=1,
                         init_checkpoint=init))
    if isinstance(kind, tuple):
        runs.append(dict(loss="ce", seed=plan.seeds[0], lr=plan.lr, data_seed=0, init_checkpoint=None))

    def load(overrides, tensor):
        at = overrides.index(f"parallel.tensor={plan.ranks}")
        overrides = overrides[:at] + [f"parallel.tensor={tensor}"] + overrides[at + 1:]
        if file.is_file():
            return load_config(str(file), overrides)
        return load_config(None, overrides, defaults=sections)

    for run in runs:
        cfg = train_config(plan, steps=plan.steps, curve_interval=max(1, plan.steps // plan.curve_points),
                           folder=plan.work / "runs" / "check", **run)
        try:
            load(cfg.overrides, 1)
        except ConfigError as err:
            raise StudyError(f"the runs' trainer config (--seq-length, --micro-batch-size, --global-batch-size, "
                             f"--precision, --set ...): {err}") from None
        if plan.ranks > 1:
            try:
                parallel_sizes(load(cfg.overrides, plan.ranks), plan.ranks)
            except ValueError as err:
                raise StudyError(f"--ranks {plan.ranks} (tensor parallel {plan.ranks}): {err}") from None


def check_ranks(plan: StudyPlan) -> None:
    """Before any run (once ``plan.meg`` is the import): the model splits into ``plan.ranks``
    tensor-parallel shards (heads, key-value groups, FFN, padded vocabulary: the trainer's
    config checks) at the study's batch sizes; else one line naming what does not divide."""
    from bebop_megatron.config import parallel_sizes

    if plan.ranks == 1:
        return
    run = train_config(plan, loss="ce", seed=0, steps=plan.steps, lr=plan.lr, data_seed=0, init_checkpoint=None,
                       curve_interval=1)
    at = run.overrides.index(f"parallel.tensor={plan.ranks}")
    # any other config error (a data file, a --set) first, as it is: not one about --ranks
    RunConfig(run.file, run.overrides[:at] + ["parallel.tensor=1"] + run.overrides[at + 1:]).load()
    try:
        parallel_sizes(run.load(), plan.ranks)
    except ValueError as err:
        raise StudyError(f"--ranks {plan.ranks} (tensor parallel {plan.ranks}): {err}") from None


def parse_existing(spec: str):
    """``"import"`` or ``("ce", N)``."""
    if spec == "import":
        return spec
    kind, _, n = spec.partition(":")
    if kind == "ce" and n.isdigit() and int(n) > 0:
        return ("ce", int(n))
    raise StudyError(f"--existing {spec!r}: 'import' (the import's MTP layers) or 'ce:N' (a head first trained "
                     "with ce for N tokens)")


def run_folder(plan: StudyPlan, condition: str, objective: str, seed: int) -> Path:
    return plan.work / "runs" / condition / objective / f"seed{seed}"


def ordered_objectives(objectives) -> list:
    return sorted(objectives, key=lambda o: (o != "ce", objectives.index(o)))


def planned_runs(plan: StudyPlan) -> list[tuple[str, int, str]]:
    return [(c, s, o) for c in plan.conditions for s in plan.seeds for o in ordered_objectives(plan.objectives)]


def head_path(plan: StudyPlan, seed: int) -> Path | None:
    kind = parse_existing(plan.existing) if "existing" in plan.conditions else None
    return None if kind in (None, "import") else plan.work / "heads" / f"ce_{kind[1]}_seed{seed}"


def shares_fresh_ce(plan: StudyPlan) -> bool:
    """The ``existing`` condition's ce head is the fresh condition's ce run (same seed, data, order,
    lr and steps) when ``--existing ce:N`` asks for as many steps as the runs: saved from it, not
    trained twice."""
    kind = parse_existing(plan.existing) if "existing" in plan.conditions else None
    return (isinstance(kind, tuple) and "fresh" in plan.conditions and "ce" in plan.objectives
            and plan.conditions.index("fresh") < plan.conditions.index("existing")
            and math.ceil(kind[1] / plan.tokens_per_step) == plan.steps)


def existing_head(plan: StudyPlan, seed: int) -> Path:
    """The ``existing`` condition's start: the import, or the seed's ce head (trained once)."""
    kind = parse_existing(plan.existing)
    if kind == "import":
        return plan.meg
    tokens = kind[1]
    head = head_path(plan, seed)
    if is_done(head):
        return head
    steps = max(1, math.ceil(tokens / plan.tokens_per_step))
    log(f"existing head (seed {seed}): ce for {steps * plan.tokens_per_step:,} tokens")
    cfg = train_config(plan, loss="ce", seed=seed, steps=steps, lr=plan.lr, data_seed=seed, init_checkpoint=None,
                       curve_interval=0)
    run_one(plan.work / "heads" / f"ce_{tokens}_seed{seed}.run", cfg, temperatures=plan.temperatures,
            heldout_files=plan.heldout_files, gamma=plan.gamma, chunk_positions=plan.chunk_positions, save_head=head,
            verbose=plan.verbose, meta={"condition": "head", "objective": "ce", "seed": seed}, ranks=plan.ranks,
            keep_checkpoint=plan.keep_checkpoints)
    mark_done(head)
    return head


def run_study(plan: StudyPlan) -> dict:
    """Every planned run not yet finished, with progress and ETA; returns ``{(c, seed, objective): record}``."""
    check_plan(plan)
    check_ranks(plan)
    runs = planned_runs(plan)
    pending = [r for r in runs if not is_finished(run_folder(plan, r[0], r[2], r[1]))]
    for condition, seed, objective in runs:  # finished runs of another study in the same --work
        folder = run_folder(plan, condition, objective, seed)
        if is_finished(folder):
            record = read_record(folder)
            want = {"tokens": plan.steps * plan.tokens_per_step, "lr": plan.lr if condition == "fresh" else plan.ft_lr}
            got = {k: record.get(k) for k in want}
            if got != want:
                raise StudyError(f"{folder} holds a run with {got} but this study asks for {want}: give another "
                                 "--work (or delete that folder)")
    log(f"study: {len(runs)} runs ({', '.join(plan.conditions)} x seeds {plan.seeds} x "
        f"{', '.join(ordered_objectives(plan.objectives))}), {plan.steps} steps x {plan.tokens_per_step:,} tokens = "
        f"{plan.steps * plan.tokens_per_step:,} tokens per run; {len(runs) - len(pending)} finished, "
        f"{len(pending)} to run")
    times: list[float] = []
    for i, (condition, seed, objective) in enumerate(pending):
        folder = run_folder(plan, condition, objective, seed)
        t0 = time.time()
        fresh = condition == "fresh"
        init = None if fresh else existing_head(plan, seed)
        cfg = train_config(plan, loss=objective, seed=seed, steps=plan.steps, lr=plan.lr if fresh else plan.ft_lr,
                           data_seed=seed if fresh else seed + 1, init_checkpoint=init,
                           curve_interval=max(1, plan.steps // plan.curve_points), folder=folder)
        head = head_path(plan, seed) if fresh and objective == "ce" and shares_fresh_ce(plan) else None
        record = run_one(folder, cfg, temperatures=plan.temperatures, heldout_files=plan.heldout_files,
                         gamma=plan.gamma, chunk_positions=plan.chunk_positions, verbose=plan.verbose, save_head=head,
                         meta={"condition": condition, "objective": objective, "seed": seed}, ranks=plan.ranks,
                         keep_checkpoint=plan.keep_checkpoints)
        if head is not None:
            mark_done(head)
        times.append(time.time() - t0)
        left = len(pending) - i - 1
        m = record["metrics"]["1"]
        curve_end = record["curve"][-1].get("accept_len_decode_rs") or [float("nan")]
        log(f"[{len(runs) - left}/{len(runs)}] {condition}/{objective}/seed{seed}: {record['tokens']:,} tokens in "
            f"{record['train_s']:.0f} s ({record['tokens_per_s']:,.0f} tokens/s); held-out T=1 alpha_RS step 1 "
            f"{m['alpha_rs_step1']:.3f}, E[L]({plan.gamma}) Eq. 12 {m[f'accept_len_rs_g{plan.gamma}']:.3f}, "
            f"decode-exact (curve) {curve_end[-1]:.3f}; run {times[-1]:.0f} s"
            + (f"; ETA {left * sum(times) / len(times):.0f} s for {left} runs" if left else ""))
    return {r: read_record(run_folder(plan, r[0], r[2], r[1])) for r in runs}
