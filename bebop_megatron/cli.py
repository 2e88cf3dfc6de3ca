"""Command-line plumbing shared by the entry points: argument parsing and clean user errors."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional

from bebop_megatron.config import Config, load_config, parallel_sizes


def parse_config(argv: list[str], description: str, defaults: Optional[dict[str, Any]] = None) -> Config:
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides are OmegaConf dotted keys, e.g. train.steps=100 parallel.tensor=2 mtp.num_steps=5.\n"
        "See bebop_megatron/config/schema.py for every field.",
    )
    parser.add_argument(
        "--config",
        help="YAML config file (fields of bebop_megatron.config.Config); replaces the embedded default",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    args = parser.parse_args(argv)
    # The embedded default describes the no-argument run; a config file replaces it.
    cfg = load_config(args.config, args.overrides, defaults=None if args.config else defaults)
    parallel_sizes(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # fail fast, before heavy imports
    return cfg


def run_cli(main: Callable[[], None]) -> None:
    """Run ``main``; one line on rank 0's stderr and a distinct exit status per outcome.

    2: a user error (``ValueError``); 3: the numerics guard gave up (``train.max_skipped_steps``
    consecutive non-finite steps); 75: preempted (SIGTERM / SIGUSR1) after a complete
    checkpoint, to be requeued (``bebop_megatron.training.signals.REQUEUE_EXIT_CODE``).
    """
    try:
        main()
    except ValueError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as err:  # bebop_megatron.training.guard.NumericsError carries exit_code
        if getattr(err, "exit_code", None) is None:
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
