"""The objective study's checks before any work (``tools/objective_study.py``): the seeds, the
prompts, the model and what the work folder was made from (:mod:`bebop_megatron.study.fingerprint`),
the import's MTP steps, every run's trainer config; and :func:`guarded`, which turns a write the file
system refuses into one line (exit 74 for a failed disk, 2 for the place).
"""

from __future__ import annotations

from pathlib import Path

from bebop_megatron.study import fingerprint
from bebop_megatron.study.driver import check_configs, check_flags, check_seeds
from bebop_megatron.study.log import DISK_ERRNOS, WRITE_ERRNOS, StudyError, write_error
from bebop_megatron.study.stages import (import_sections, import_steps, is_done, model_folder, prompt_sets,
                                         write_problem)


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: distinct integers from 0 to 2**32 - 2, comma-separated."""
    try:
        seeds = [int(x) for x in (x.strip() for x in text.split(",")) if x]
    except ValueError:
        raise StudyError(f"--seeds {text!r}: comma-separated integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise StudyError(f"--seeds {text!r}: distinct integers, at least one")
    check_seeds(seeds)
    return seeds


def check_before_work(args, plan, work: Path) -> tuple[Path | None, dict | None, dict]:
    """Every check that needs no work, before the first write: the prompts, the model, what the
    work folder was made from (:mod:`bebop_megatron.study.fingerprint`), the import's MTP steps,
    every run's trainer config (:func:`bebop_megatron.study.driver.check_configs`). Returns the
    model folder, the prompt sets and the fingerprint to record."""
    if not args.report_only:
        check_flags(plan)  # before a registry model is fetched
    sets = prompt_sets(Path(args.prompts), args.num_train, args.num_heldout) if args.prompts else None
    if args.report_only and args.unpack is None:  # nothing is generated: a model only where it is at hand
        hf = Path(args.hf_dir) if args.hf_dir and (Path(args.hf_dir) / "config.json").is_file() else None
    else:
        hf = model_folder(args.model, args.hf_dir)
    given = Path(args.megatron).resolve() if args.megatron else None
    current = {
        "model": fingerprint.folder_fingerprint(hf) if hf is not None else None,
        "import": fingerprint.folder_fingerprint(given, recursive=True) if given and given.is_dir() else None,
        "prompts": None if sets is None else fingerprint.prompts_fingerprint(
            sets, f"{Path(args.prompts).resolve()} (--num-train {args.num_train}, --num-heldout {args.num_heldout})"),
    }
    record = fingerprint.check(work, current)
    if args.report_only:
        return hf, sets, record
    meg = given or work / "megatron"
    have = import_steps(meg) if given or is_done(meg) else None
    if have is not None and have != args.mtp_num_steps and (args.mtp_steps_given or not given):
        where = f"--megatron {meg}" if given else f"this work folder's import {meg}"
        raise StudyError(f"--mtp-num-steps {args.mtp_num_steps}{'' if args.mtp_steps_given else ' (the default)'}: "
                         f"{where} has mtp.num_steps={have} (its bebop_model.yaml): give --mtp-num-steps {have}, "
                         + ("or another import" if given else f"or another --work to import again with "
                                                               f"{args.mtp_num_steps}"))
    plan.meg = meg
    if args.train_data is not None:
        plan.train_files, plan.valid_files = split(args.train_data), split(args.heldout_data)
    sections = None
    if not (meg / "bebop_model.yaml").is_file() and not given:
        sections = import_sections(hf, args.mtp_num_steps)
    check_configs(plan, sections=sections)
    return hf, sets, record


def split(text: str) -> list[str]:
    """A comma-separated flag's items."""
    return [x.strip() for x in text.split(",") if x.strip()]


def guarded(main, argv=None) -> None:
    """``main(argv)``; a write the file system refuses is one line, never a traceback: exit 74 when
    the disk failed (no space left, quota, I/O: :class:`~bebop_megatron.study.log.StudyDiskError`,
    as the trainer's), 2 for the place (read-only, permissions, a file in the way)."""
    try:
        main(argv)
    except OSError as err:
        if err.errno not in DISK_ERRNOS and err.errno not in WRITE_ERRNOS:
            raise
        write_problem(err)  # drops the frames' locals now (see there)
        raise write_error(err, "the study") from None
