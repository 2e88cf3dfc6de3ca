"""One process of an objective-study run in several processes (``tools/objective_study.py --ranks N``).

    python -m torch.distributed.run --standalone --nproc_per_node N -m bebop_megatron.study.rank RUN/launch.json

:func:`bebop_megatron.study.runs.launch_run` writes ``launch.json`` (the run's folder, its config
file and overrides, the evaluation's settings) and starts the
processes; each loads the config (``parallel.tensor=N``) and runs
:func:`bebop_megatron.study.runs.train_and_evaluate`, rank 0 writing the folder's files and the
log lines. Errors are :func:`bebop_megatron.cli.run_cli`'s one ``error:`` line; a process whose
launcher is gone stops (:func:`bebop_megatron.launcher.watch_launcher`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    from bebop_megatron.study.log import mute, set_log_file
    from bebop_megatron.study.runs import RunConfig, train_and_evaluate

    spec = json.loads(Path(argv[0]).read_text())
    if int(os.environ.get("RANK", "0")) == 0:
        set_log_file(None if spec["log_file"] is None else Path(spec["log_file"]))
    else:
        mute()
    cfg = RunConfig(spec["config_file"], spec["overrides"]).load()
    train_and_evaluate(Path(spec["folder"]), cfg, temperatures=tuple(spec["temperatures"]), gamma=spec["gamma"],
                       chunk_positions=spec["chunk_positions"], heldout_files=spec.get("heldout_files") or {},
                       save_head=None if spec["save_head"] is None else Path(spec["save_head"]),
                       verbose=spec["verbose"], meta=spec["meta"], keep_checkpoint=spec["keep_checkpoint"])


if __name__ == "__main__":
    from bebop_megatron.cli import run_cli

    run_cli(lambda: main(sys.argv[1:]))
