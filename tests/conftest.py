"""Shared fixtures: ``hf_dir``, a small local Hugging Face tokenizer (tests/helpers/data.py);
the quick tier (``pytest -m quick``): every test outside :data:`SLOW_FILES` and ``tests/distributed``
and not marked ``slow``, for the inner loop (the whole suite stays the check before a commit).

The suite runs in two pytest-xdist workers (``pytest.ini``: ``-n 2 --dist loadfile``, a file's
tests in one worker so its module fixtures are built once); each worker's torch uses one thread,
so the two share 2 cores without oversubscription (measured on 2026-12-04: 724 s against 1,175 s serially;
docs/developing.md has the latest time).
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers.data import hf_dir  # noqa: F401

import pytest  # noqa: E402

# Files whose tests launch processes (torchrun, the tools), train or convert models: each takes
# seconds to minutes. With tests/distributed/ and tests marked ``slow`` they are left out of the
# quick tier.
SLOW_FILES = {
    "test_bench_frozen_step.py", "test_cli.py", "test_convert_deepseek.py", "test_convert_export.py",
    "test_convert_import.py", "test_convert_overwrite.py", "test_convert_qwen.py", "test_data_fingerprint.py",
    "test_eval_acceptance.py", "test_generate_megatron.py", "test_export_backbone.py", "test_forkserver.py", "test_gpu_real_model.py",
    "test_gpu_script.py",
    "test_grad_norm_once.py", "test_kernel_triton.py", "test_lr_logged.py", "test_mtp_chain.py", "test_mtp_init.py",
    "test_production_guard.py", "test_production_resume.py", "test_production_slurm.py",
    "test_production_slurm_real.py",
    "test_real_model_prompts.py", "test_serve_vllm.py", "test_speculative_generate.py", "test_synthetic_backbone.py",
    "test_trainer_data.py", "test_training_signal.py",
}

# Slow tests in the other files (subprocesses, Monte Carlo, the Triton interpreter), by name.
SLOW_TESTS = {
    "test_analyze_rl_acceptance.py::test_errors", "test_data_errors.py::test_preprocess_cli_",
    "test_data_indexed.py::test_train_on_all_and_mismatches", "test_generate_responses.py::test_cli_subprocess_",
    "test_losses_cold_start.py::test_nla_kinds_run_on_the_triton_kernel", "test_lk_triton.py::test_interpreted",
    "test_objective_study.py::test_study_dry_run", "test_objective_study.py::test_user_mistakes",
    "test_objective_study.py::test_ranks_",
    "test_speculative.py::test_monte_carlo_acceptance_and_output_distribution",
    "test_data_rollouts.py::test_a_head_trains_from",
}


# Files of the quick tier that take 15-30 s each (Monte Carlo, every config field, SDPA cases, float64
# gradchecks): handed out right after the slow files, so that none of them is the last to run.
LONG_QUICK_FILES = {"test_speculative.py", "test_config.py", "test_attention_sdpa.py", "test_losses.py"}


# Slow files whose time is mostly spent waiting (on Slurm's scheduler and its requeue delay, not on
# this worker's CPU): handed out before everything else.
FIRST_FILES = {"test_production_slurm_real.py"}


def _slow_first(item) -> int:
    """-1 for FIRST_FILES, 0 for tests/distributed/, 1 for SLOW_FILES, 2 for LONG_QUICK_FILES, 3 for
    the rest: the order files are handed to the xdist workers (``--no-loadscope-reorder`` in pytest.ini
    keeps it), so that the minutes-long files start first and the many short ones fill the gaps at the
    end, instead of a long file starting last while the other worker idles."""
    if item.path.name in FIRST_FILES:
        return -1
    if item.path.parent.name == "distributed":
        return 0
    return 1 if item.path.name in SLOW_FILES else 2 if item.path.name in LONG_QUICK_FILES else 3


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_first)  # stable: a file's tests keep their order
    for item in items:
        path = item.path
        name = f"{path.name}::{item.name}"
        if path.parent.name != "distributed" and path.name not in SLOW_FILES and not item.get_closest_marker("slow") \
                and not any(name.startswith(prefix) for prefix in SLOW_TESTS):
            item.add_marker(pytest.mark.quick)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tiny tensors: more threads only add wake-up latency)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def synthetic_cache(tmp_path_factory):
    """``(cache_dir, path)``: the tiny fitted synthetic backbone of ``tests/helpers/synthetic_fit.py``,
    fitted once per session into its own cache (``BEBOP_MEGATRON_CACHE``, never the user's), its fit
    child forked by the fork server (``test_fit_is_deterministic_and_reaches_the_entropy_rate`` fits
    again in a fresh interpreter and compares the files)."""
    import os

    from bebop_megatron.training import synthetic_backbone
    from tests.helpers import forkserver
    from tests.helpers.synthetic_fit import tiny_config

    cache = tmp_path_factory.mktemp("bebop_cache")
    saved = os.environ.get("BEBOP_MEGATRON_CACHE")
    os.environ["BEBOP_MEGATRON_CACHE"] = str(cache)
    try:
        cfg = tiny_config()
        path = synthetic_backbone.resolve(cfg)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(synthetic_backbone.subprocess, "run", forkserver.run)
            synthetic_backbone.run_fit(cfg, path, log=lambda line: None)
    finally:
        if saved is None:
            os.environ.pop("BEBOP_MEGATRON_CACHE")
        else:
            os.environ["BEBOP_MEGATRON_CACHE"] = saved
    return cache, path


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm of this host (``tests/helpers/slurm_cluster.py``), started once per worker
    that needs it and stopped at its end; skipped in one line without Slurm and munge, or root."""
    from tests.helpers.slurm_cluster import SlurmCluster, missing

    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def slurm_two_nodes(tmp_path_factory):
    """A two-node Slurm on this host: ``node1`` and ``node2``, each slurmd in its own network
    namespace under its own hostname and address (``tests/helpers/slurm_cluster.py``), created
    and removed by the fixture; skipped in one line where that cannot run (no Slurm, no root, no
    ``ip``, or namespaces this machine cannot create)."""
    from tests.helpers.slurm_cluster import SlurmCluster, missing, missing_namespaces

    reason = missing() or missing_namespaces()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm2"), nodes=2).start()
    yield cluster
    cluster.stop()
