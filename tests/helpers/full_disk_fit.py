"""The synthetic backbone's fit child (``python -m bebop_megatron.training.synthetic_backbone
CONFIG OUT``) on a full disk: its shard writes fail with ENOSPC, as write() raises it (no file
name). Four fit steps instead of 100: the save is what is tested.

Usage: python tests/helpers/full_disk_fit.py CONFIG OUT
"""

from __future__ import annotations

import errno
import functools
import os
import sys

from megatron.core.dist_checkpointing.strategies import filesystem_async

from bebop_megatron.training import synthetic_backbone

real_write = filesystem_async._write_item


@functools.wraps(real_write)  # Megatron inspects its signature
def full_disk_write(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


if __name__ == "__main__":
    filesystem_async._write_item = full_disk_write
    synthetic_backbone.FIT_STEPS = 4
    synthetic_backbone.main(sys.argv[1:])
