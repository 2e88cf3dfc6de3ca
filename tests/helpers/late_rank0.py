"""``examples/pretrain_mtp.py`` with rank 0 started ``LATE_RANK0_S`` seconds (3) after the others:
under torchrun, another rank reaches an error every rank raises (a config error) first.

    torchrun --nproc_per_node 2 tests/helpers/late_rank0.py --config CONFIG key=value ...
"""

import os
import runpy
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "pretrain_mtp.py"

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(float(os.environ.get("LATE_RANK0_S", "3")))
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")
