"""Command-line plumbing shared by the entry points: argument parsing and clean user errors."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional

from bebop_megatron.config import Config, load_config, parallel_sizes
from bebop_megatron.launcher import leave_report_to_rank0, watch_launcher
from bebop_megatron.platform.outputs import (  # noqa: F401  (the entry points' output helpers, re-exported)
    OUTPUT_WRITE_EXIT_CODE,
    OutputWriteError,
    check_output_dir,
    check_output_file,
    finite,
    output_write_error,
    write_json,
)


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
