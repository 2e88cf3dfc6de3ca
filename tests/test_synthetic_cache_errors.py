"""The synthetic-backbone cache when it cannot be used as is (issue 26 item 15,
bebop_megatron/training/synthetic_backbone.py):

- a complete entry with a truncated file (it failed to load with an ``EOFError`` after the
  model build) is fitted again, with a notice;
- a cache that cannot be written (read-only, a path through a file) and a full disk during the
  fit (it said "Worker failure ... RuntimeError"): one ``CacheError`` line naming the cache and
  ``BEBOP_MEGATRON_CACHE``;
- a fit interrupted by Ctrl-C (or failing) leaves no ``<key>.tmp<PID>`` directory.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys

import pytest

from bebop_megatron.training import synthetic_backbone
from tests.helpers import forkserver
from tests.helpers.launch import HELPERS
from tests.helpers.synthetic_fit import tiny_config

HINT = "set BEBOP_MEGATRON_CACHE to a writable directory with space, or use model.backbone_init=random"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BEBOP_MEGATRON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def entries(cache) -> list[str]:
    folder = cache / "synthetic_backbone"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


@pytest.mark.parametrize("name, problem", [
    (".metadata", ".metadata is unreadable or truncated ("),
    ("__0_0.distcp", "__0_0.distcp is truncated ("),
    ("fit.json", "fit.json is unreadable or truncated (JSONDecodeError)"),
])
def test_a_damaged_entry_is_fitted_again(synthetic_cache, cache, monkeypatch, name, problem):
    _, fitted = synthetic_cache
    path = synthetic_backbone.resolve(tiny_config())
    shutil.copytree(fitted, path)
    assert synthetic_backbone.entry_problem(path) is None
    data = open(os.path.join(path, name), "rb").read()
    with open(os.path.join(path, name), "wb") as f:
        f.write(data[: len(data) // 2])
    fits, lines = [], []
    monkeypatch.setattr(synthetic_backbone, "run_fit", lambda cfg, p, log=print: fits.append(p))
    assert synthetic_backbone.prepare(tiny_config(), log=lines.append) == path
    assert fits == [path] and not os.path.exists(path)  # removed, then fitted again (here: recorded)
    assert lines[0].startswith(f"backbone: the cached entry {path} is damaged ({problem}") and \
        lines[0].endswith("): fitting it again"), lines


def test_an_unwritable_cache_is_one_line(cache, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("BEBOP_MEGATRON_CACHE", str(blocker / "cache"))
    with pytest.raises(synthetic_backbone.CacheError) as err:
        synthetic_backbone.prepare(tiny_config(), log=lambda line: None)
    assert str(err.value) == (f"synthetic-backbone cache {blocker / 'cache'} cannot be written (Not a directory: "
                              f"{blocker / 'cache'}); {HINT}")
    monkeypatch.setenv("BEBOP_MEGATRON_CACHE", str(cache))

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(synthetic_backbone.os, "makedirs", read_only)
    with pytest.raises(synthetic_backbone.CacheError) as err:
        synthetic_backbone.prepare(tiny_config(), log=lambda line: None)
    assert str(err.value) == (f"synthetic-backbone cache {cache} cannot be written (Read-only file system: "
                              f"{cache / 'synthetic_backbone'}); {HINT}")


def test_ctrl_c_during_the_fit_leaves_no_tmp(cache, monkeypatch):
    def interrupted(cmd, **kwargs):
        assert entries(cache) == [os.path.basename(cmd[-1])]  # <key>.tmp<PID>, being written
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic_backbone.subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synthetic_backbone.prepare(tiny_config(), log=lambda line: None)
    assert entries(cache) == []


def test_a_full_disk_during_the_fit_is_named(cache, monkeypatch):
    def full_disk_child(cmd, **kwargs):  # the real child, with its shard writes failing (ENOSPC)
        assert cmd[:3] == [sys.executable, "-m", "bebop_megatron.training.synthetic_backbone"]
        return forkserver.run([sys.executable, str(HELPERS / "full_disk_fit.py"), *cmd[3:]], **kwargs)

    monkeypatch.setattr(synthetic_backbone.subprocess, "run", full_disk_child)
    cfg = tiny_config()
    path = synthetic_backbone.resolve(cfg)
    with pytest.raises(synthetic_backbone.CacheError) as err:
        synthetic_backbone.run_fit(cfg, path, log=lambda line: None)
    tmp = f"{path}.tmp{os.getpid()}"
    assert str(err.value) == (f"synthetic-backbone cache: no space left on device while writing "
                              f"{os.path.join(tmp, '__0_0.distcp')}; {HINT}")
    assert entries(cache) == []


SIGTERM_DURING_FIT = """
import os, signal, sys
from bebop_megatron.training import synthetic_backbone
from tests.helpers.synthetic_fit import tiny_config

def terminated(cmd, **kwargs):  # the fit child is running: the job gets SIGTERM (timeout, scancel)
    print(sorted(os.listdir(os.path.dirname(cmd[-1]))), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not stop the fit")

synthetic_backbone.subprocess.run = terminated
synthetic_backbone.prepare(tiny_config(), log=lambda line: None)
"""


def test_sigterm_during_the_fit_leaves_no_tmp(cache, tmp_path):
    proc = forkserver.run([sys.executable, "-c", SIGTERM_DURING_FIT], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BEBOP_MEGATRON_CACHE": str(cache)}, cwd=str(HELPERS.parents[1]))
    assert proc.returncode == 128 + 15, proc.stderr[-2000:]  # SystemExit(143), not a kill by the signal (-15)
    assert ".tmp" in proc.stdout  # the entry was being written
    assert entries(cache) == []
