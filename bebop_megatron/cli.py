"""Command-line plumbing shared by the entry points: argument parsing and clean user errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable, Optional

from bebop_megatron.config import Config, load_config, parallel_sizes
from bebop_megatron.launcher import leave_report_to_rank0, watch_launcher


def parse_config(argv: list[str], description: str, defaults: Optional[dict[str, Any]] = None) -> Config:
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides are OmegaConf dotted keys, e.g. train.steps=100 parallel.tensor=2 mtp.num_steps=5.\n"
        "See bebop_megatron/config/schema.py for every field.",
    )
    parser.add_argument(
        "--config",
        help="YAML config file (fields of bebop_megatron.config.Config); replaces the embedded default; "
        "save.dir defaults to checkpoints/<file stem>",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    args = parser.parse_args(argv)
    # The embedded default describes the no-argument run; a config file replaces it.
    cfg = load_config(args.config, args.overrides, defaults=None if args.config else defaults)
    parallel_sizes(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # fail fast, before heavy imports
    return cfg


def _same_on_every_rank(err: BaseException) -> bool:
    """Errors every rank raises alike (config and data checks, agreed decisions): rank 0 reports them."""
    if getattr(err, "same_on_every_rank", False):
        return True
    data_errors = sys.modules.get("bebop_megatron.data.errors")  # not imported here: the data package is heavy
    return data_errors is not None and isinstance(err, data_errors.DataError)


def _close_distributed_at_exit() -> None:
    """Every rank exits alike: destroy the process groups before the interpreter's teardown
    (:func:`bebop_megatron.platform.close_distributed_at_exit`; not imported here: it is heavy)."""
    platform = sys.modules.get("bebop_megatron.platform")
    if platform is not None:
        platform.close_distributed_at_exit()


def _report(err: BaseException, exit_code: int) -> None:
    """``error: ...`` on stderr: rank 0 prints every error, another rank the ones only it may have
    raised, with its rank (``error: [rank 3] ...``); then exit with ``exit_code`` (under torchrun,
    another rank leaves rank 0 the time to print the errors it reports:
    :func:`bebop_megatron.launcher.leave_report_to_rank0`)."""
    rank = int(os.environ.get("RANK", "0"))
    if _same_on_every_rank(err):
        _close_distributed_at_exit()
    if rank == 0:
        print(f"error: {err}", file=sys.stderr, flush=True)
    elif not _same_on_every_rank(err):
        print(f"error: [rank {rank}] {err}", file=sys.stderr, flush=True)
    else:
        leave_report_to_rank0()  # under torchrun: until rank 0 has printed it
    sys.exit(exit_code)


def run_cli(main: Callable[[], None]) -> None:
    """Run ``main``; one ``error:`` line and a distinct exit status per outcome.

    2: a user error (``ValueError``); 3: the numerics guard gave up (``train.max_skipped_steps``
    consecutive non-finite steps); 74: a checkpoint could not be written (e.g. no space left on
    device; ``latest`` still names the previous one); 75: preempted (SIGTERM / SIGUSR1) after a
    complete checkpoint, to be requeued (``bebop_megatron.training.signals.REQUEUE_EXIT_CODE``);
    130: Ctrl-C, after the trainer's complete checkpoint (``INTERRUPT_EXIT_CODE``) or at once.
    Under torchrun the rank also stops when its launcher is gone (:func:`watch_launcher`).
    """
    watch_launcher()
    try:
        main()
        _close_distributed_at_exit()  # every rank got here: a success
    except SystemExit as exit_:  # the trainer's Preempted (75, or 130 after Ctrl-C), agreed by every rank
        if getattr(exit_, "message", None) is not None:
            _close_distributed_at_exit()
        raise
    except ValueError as err:
        _report(err, 2)
    except RuntimeError as err:  # NumericsError, CheckpointWriteError carry exit_code
        if getattr(err, "exit_code", None) is None:
            raise
        _report(err, err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf: a statistic with nothing to measure)
    replaced by None, recursively through dicts, lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: str, obj: Any, indent: int = 1) -> None:
    """Write ``obj`` as valid JSON: non-finite floats become ``null`` (:func:`finite`; bare
    ``NaN`` is not JSON), anything else that JSON cannot hold raises. Every tool's JSON output."""
    with open(path, "w") as f:
        json.dump(finite(obj), f, indent=indent, allow_nan=False)


def check_output_file(path: str, flag: str) -> None:
    """Before any work: ``path`` can be written as a file (its directory exists; it is not a
    directory itself)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist; create it first")


OUTPUT_WRITE_EXIT_CODE = 74
"""Exit status when an output cannot be written for want of space (``EX_IOERR``), as a checkpoint."""


class OutputWriteError(RuntimeError):
    """An output file could not be written: no space left on device or quota exceeded (exit 74)."""

    exit_code = OUTPUT_WRITE_EXIT_CODE


def output_write_error(err: OSError, flag: str, path: str, then: str = "") -> Exception:
    """The one-line error for ``err``, raised while writing ``path`` (the output ``flag`` names;
    ``then``: what follows, e.g. how to resume): :class:`OutputWriteError` (exit 74) for a full
    disk or quota, else a ``ValueError`` (exit 2: a read-only file system, permissions)."""
    import errno

    where, then = err.filename or path, f"; {then}" if then else ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        return OutputWriteError(f"{flag} {path}: {what} while writing {where}{then}")
    return ValueError(f"{flag} {path} cannot be written ({err.strerror or err}: {where}){then}")


def check_output_dir(path: str, flag: str) -> None:
    """Before any work: ``path`` is a directory or can be created as one (neither it nor a
    directory above it is an existing file)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "" if probe == os.path.abspath(path) else f": {probe}"
        raise ValueError(f"{flag} {path}{where} exists and is not a directory")
