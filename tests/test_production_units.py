"""Production pieces without a process group: FLOPs/MFU, preemption signals, FP8 checks,
checkpoint retention, the new config fields and the cluster example config."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from bebop_megatron.config import ConfigError, load_config, parallel_sizes

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "examples" / "configs" / "cluster" / "moe_30b_4node.yaml"

# H=8, F=16, 2 query heads, 1 KV head, head dim 4, S=4, V=100 padded to 128, 2 layers, K=2, 4 tokens.
TINY = [
    "model.hidden_size=8", "model.ffn_hidden_size=16", "model.num_attention_heads=2", "model.num_query_groups=1",
    "model.vocab_size=100", "model.num_layers=2", "mtp.num_steps=2", "train.seq_length=4",
    "train.micro_batch_size=1", "train.global_batch_size=1",
]


def test_step_flops_dense_against_a_hand_count():
    from bebop_megatron.training.flops import step_flops

    # attention/token: QKV 2*8*(2*4 + 2*1*4) = 256, out 2*(2*4)*8 = 128, QK^T + AV 4*4*2*4 = 128
    # MLP/token: 3 matrices 8x16 -> 6*8*16 = 768; layer = 512 + 768 = 1280
    # backbone/token: 2 layers + output layer 2*8*128 = 2560 + 2048 = 4608
    # MTP/token/step: 3 * (eh_proj 4*8*8 = 256 + 1280) + output layer fwd + input grad 4*8*128 = 4608 + 4096
    flops = step_flops(load_config(overrides=TINY))
    assert flops["backbone_forward"] == 4 * 4608
    assert flops["mtp_forward_backward"] == 4 * 2 * (4608 + 4096)
    assert flops["total"] == 4 * 4608 + 4 * 2 * 8704


def test_step_flops_moe_against_a_hand_count():
    from bebop_megatron.training.flops import step_flops

    cfg = load_config(overrides=TINY + [
        "model.family=moe", "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=6",
        "model.moe_shared_expert_intermediate_size=10", "model.moe_first_dense_layers=1",
    ])
    # MoE MLP/token: router 2*8*4 = 64, 2 experts 2*6*8*6 = 576, shared 6*8*10 = 480 -> 1120
    # MoE layer = 512 + 1120 = 1632; the first layer is dense (1280); the MTP layer is MoE
    flops = step_flops(cfg)
    assert flops["backbone_forward"] == 4 * (1280 + 1632 + 2048)
    assert flops["mtp_forward_backward"] == 4 * 2 * (3 * (256 + 1632) + 4096)


def test_mfu_and_peak_lookup():
    from bebop_megatron.training.flops import mfu, peak_tflops_per_device

    assert mfu(2e12, 1.0, 4, 1.0) == pytest.approx(0.5)  # 2 TFLOP in 1 s on 4 x 1 TFLOP/s
    assert mfu(1e12, 1.0, 1, None) is None
    assert peak_tflops_per_device("cpu", "bf16", None) is None
    assert peak_tflops_per_device("cpu", "bf16", 7.5) == 7.5


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_handler_records_the_signal(sig):
    from bebop_megatron.training.signals import REQUEUE_EXIT_CODE, Preempted, PreemptionHandler

    handler = PreemptionHandler().install()
    try:
        os.kill(os.getpid(), sig)
        assert handler.received == sig.name
    finally:
        handler.uninstall()
    assert signal.getsignal(sig) is not handler._handle
    with pytest.raises(SystemExit) as exc:
        raise Preempted("saved")
    assert exc.value.code == REQUEUE_EXIT_CODE == 75


def test_ctrl_c_is_recorded_once_and_a_second_one_stops_at_once(capfd):
    """(issue 48 item 13) The first SIGINT is recorded as SIGTERM is (the trainer saves at the next
    step and exits 130) with one line; a second raises KeyboardInterrupt; uninstall gives Ctrl-C back."""
    from bebop_megatron.training.signals import INTERRUPT_EXIT_CODE, Preempted, PreemptionHandler, stop_message

    before = signal.getsignal(signal.SIGINT)
    handler = PreemptionHandler(interrupt_notice="Ctrl-C: saving").install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert (handler.received, handler.interrupted, handler.preempted) == ("SIGINT", True, None)
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption after it: recorded too (its exit status wins)
        assert (handler.received, handler.preempted) == ("SIGINT", "SIGTERM")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGINT) is before
    assert capfd.readouterr().err.splitlines() == [
        "Ctrl-C: saving", "Ctrl-C again: stopping now, without the checkpoint of this step"]
    assert stop_message("SIGINT", "c/iter_0000005", 5, interrupted=True) == (
        "SIGINT (Ctrl-C): checkpoint c/iter_0000005 at step 5; exiting with 130 (train.resume=auto continues from it)")
    assert stop_message(None, None, 5, interrupted=True) == (  # another rank got it; nothing to save into
        "SIGINT (Ctrl-C): checkpoint (none: save.dir is null) at step 5; exiting with 130")
    with pytest.raises(SystemExit) as exc:
        raise Preempted("saved", INTERRUPT_EXIT_CODE)
    assert exc.value.code == INTERRUPT_EXIT_CODE == 130


def test_the_stop_line_says_when_the_launcher_is_gone(monkeypatch):
    """(issue 26 item 23) After the watchdog's SIGTERM the last line read "SIGTERM: ... so that the
    launcher requeues the job", after an "error:" line: now it says what happened."""
    from bebop_megatron import launcher
    from bebop_megatron.training.signals import stop_message

    assert stop_message("SIGTERM", "c/iter_0000005", 5) == (
        "SIGTERM: checkpoint c/iter_0000005 at step 5; exiting with 75 so that the launcher requeues the job")
    assert stop_message("SIGTERM", "c/iter_0000005", 5, launcher_gone=4242) == (
        "the launcher (pid 4242) is gone (SIGTERM): checkpoint c/iter_0000005 at step 5; stopped with exit status 75 "
        "(train.resume=auto continues from it)")
    assert stop_message(None, None, 3, launcher_gone=4242).startswith(  # another rank got the signal first
        "the launcher (pid 4242) is gone: checkpoint (none: save.dir is null) at step 3;")
    monkeypatch.setattr(launcher, "_watched", None)  # not under torchrun
    assert launcher.gone() is None
    monkeypatch.setattr(launcher, "_watched", os.getppid())  # still the parent
    assert launcher.gone() is None
    monkeypatch.setattr(launcher, "_watched", 4242)  # no longer the parent
    assert launcher.gone() == 4242


def test_fp8_without_transformer_engine_fails_with_the_install_hint():
    from bebop_megatron.training.precision import check_fp8_available, fp8_transformer_settings

    with pytest.raises(ValueError, match=r"needs a CUDA GPU with FP8 support \(device is cpu\)"):
        check_fp8_available("cpu", "blockwise")
    # Transformer Engine is not installable here: the check that follows the device one
    with pytest.raises(ValueError, match=r"needs Transformer Engine.*pip install -e '\.\[gpu\]'"):
        check_fp8_available("cuda", "mxfp8")
    cfg = load_config(overrides=["precision=fp8", "fp8.recipe=tensorwise", "fp8.format=e4m3"])
    assert fp8_transformer_settings(cfg) == {
        "fp8": "e4m3", "fp8_recipe": "tensorwise", "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max",
    }
    assert fp8_transformer_settings(load_config()) == {}


def test_fp8_settings_are_valid_megatron_transformer_config_fields():
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from bebop_megatron.training.precision import fp8_transformer_settings

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    for recipe in ("delayed", "tensorwise", "mxfp8", "blockwise"):
        settings = fp8_transformer_settings(load_config(overrides=["precision=fp8", f"fp8.recipe={recipe}"]))
        assert set(settings) <= names
        from megatron.core.enums import Fp8Recipe

        assert Fp8Recipe(settings["fp8_recipe"])  # a recipe Megatron-Core knows


def test_fp8_settings_reach_the_models_transformer_config():
    # Set when the config is built, so that layers constructed from it already see them.
    from bebop_megatron.model.builder import transformer_config

    cfg = load_config(overrides=["precision=fp8", "fp8.recipe=tensorwise", "fp8.format=e4m3"])
    tconfig = transformer_config(cfg, "cuda", use_te=True)
    assert (tconfig.fp8, tconfig.fp8_recipe, tconfig.fp8_amax_history_len) == ("e4m3", "tensorwise", 1024)
    assert transformer_config(load_config(), "cpu", use_te=False).fp8 is None


BAD = [
    (["fp8.recpe=delayed"], "unknown config key 'fp8.recpe' (did you mean 'fp8.recipe'?)"),
    (["logging.wandb.mod=offline"], "unknown config key 'logging.wandb.mod' (did you mean 'logging.wandb.mode'?)"),
    (["save.keep_lats=2"], "unknown config key 'save.keep_lats' (did you mean 'save.keep_last'?)"),
    (["fp8.recipe=mxfp4"], "fp8.recipe='mxfp4' must be one of delayed, tensorwise, mxfp8, blockwise"),
    (["logging.wandb.mode=cloud"], "logging.wandb.mode='cloud' must be one of online, offline, disabled"),
    (["train.max_skipped_steps=0"], "train.max_skipped_steps=0 must be >= 1"),
    (["save.keep_last=-1"], "save.keep_last=-1 must be >= 0 (0 keeps every checkpoint)"),
    (["save.async_save=maybe"], "config field 'save.async_save'"),
    (["logging.peak_tflops=-1"], "logging.peak_tflops=-1.0 must be > 0 (or null)"),
    (["precision=fp8", "model.transformer_impl=local"], "precision=fp8 needs model.transformer_impl"),
    # issue 36 item 8: refused before anything runs (the quick start fitted its backbone first, then hung)
    (["model.max_position_embeddings=512", "train.seq_length=1024"],
     "train.seq_length=1024 is above model.max_position_embeddings=512: lower it, or set "
     "train.allow_beyond_max_positions=true to extrapolate RoPE past the positions the backbone was trained on"),
    (["train.seq_length=100000000"], "train.seq_length=100000000 is above model.max_position_embeddings=4096"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[b[0][-1] for b in BAD])
def test_production_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=overrides)
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("world_size", [16, 32], ids=["2-nodes", "4-nodes"])
def test_cluster_example_config_validates(tmp_path, world_size):
    data = tmp_path / "rft.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n')
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")  # a directory that holds tokenizer files (not loaded here)
    # the cluster's paths do not exist here: point the data at local stand-ins
    cfg = load_config(str(CLUSTER), [f"data.train_files=[{data}]", f"data.tokenizer={tokenizer}"])
    sizes = parallel_sizes(cfg, world_size)
    assert sizes["data"] == world_size // 4 and sizes["num_microbatches"] == 256 // (world_size // 4)
    assert (cfg.precision, cfg.fp8.recipe, cfg.parallel.expert, cfg.model.num_experts) == ("fp8", "blockwise", 8, 128)
    with pytest.raises(ConfigError, match=r"parallel.expert=8 \* parallel.expert_tensor=1 must divide"):  # one node
        parallel_sizes(cfg, 8)


def test_keep_last_prunes_old_checkpoints_but_never_latest(tmp_path):
    from bebop_megatron.training.checkpoint import list_checkpoints, prune_checkpoints

    for step in (1, 2, 3, 4):
        (tmp_path / f"iter_{step:07d}").mkdir()
    (tmp_path / "latest").write_text("iter_0000002")  # e.g. a newer save never completed
    deleted = prune_checkpoints(str(tmp_path), keep_last=2)
    assert sorted(deleted) == ["iter_0000001"]
    assert list_checkpoints(str(tmp_path)) == ["iter_0000002", "iter_0000003", "iter_0000004"]
    (tmp_path / "latest").write_text("iter_0000004")
    prune_checkpoints(str(tmp_path), keep_last=1)
    assert list_checkpoints(str(tmp_path)) == ["iter_0000004"]


def test_wandb_run_id_is_kept_in_the_save_dir(tmp_path):
    from bebop_megatron.training.monitor import wandb_run_id

    assert wandb_run_id(None) is None
    first = wandb_run_id(str(tmp_path / "ckpt"))
    assert first and wandb_run_id(str(tmp_path / "ckpt")) == first  # a resumed run: same id
    assert wandb_run_id(str(tmp_path / "other")) != first


def test_seq_length_beyond_max_positions_only_with_the_override():
    cfg = load_config(overrides=["model.max_position_embeddings=512", "train.seq_length=1024",
                                 "train.allow_beyond_max_positions=true"])
    assert cfg.train.seq_length == 1024


def test_eta_after_a_resume_counts_only_this_process_steps():
    from bebop_megatron.training.step_metrics import StepMetrics, step_line

    # resumed at step 20, 10 steps in 10 s: 1 s a step, 10 steps left -> 10 s (not 10/30*10 = 3 s)
    m = StepMetrics(step=30, loss=1.0, grad_norm=0.0, lr=1e-4, top1=[0.5], ce=[0.0], alpha_rs=[0.5],
                    entropy_target=[1.0], accept_len_rs=[1.5])
    line = step_line(m, 10.0, steps=40, loss_type="tv", skipped_total=0, start_step=20)
    assert line.endswith("ETA 10s"), line
    assert step_line(m, 30.0, steps=40, loss_type="tv", skipped_total=0).endswith("ETA 10s")  # a fresh run


def test_a_short_write_on_a_full_disk_is_named(monkeypatch, tmp_path):
    """Issue 36: on a real full disk torch's zip writer fails with "[enforce fail at
    inline_container.cc] unexpected pos" (a RuntimeError, no errno): the error line said
    "Worker failure: ... RuntimeError". A write failure on a filesystem without space is named."""
    import errno

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from bebop_megatron.platform import checkpoint_writer
    from bebop_megatron.training.write_errors import write_problem

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data",
                        staticmethod(lambda transforms, index, bucket, *a, **k: (index, short)))
    checkpoint_writer.record_write_errors()  # wraps the failing writer above
    shard = str(tmp_path / "__0_0.distcp")
    monkeypatch.setattr(checkpoint_writer, "FULL_BELOW", 1 << 62, raising=False)  # tmp_path's filesystem counts as full
    with pytest.raises(OSError) as err:  # the main writer (no results queue) raises it
        FileSystemWriterAsync.write_preloaded_data([], 0, (shard,), results_queue=None)
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, shard)
    assert write_problem(None, str(tmp_path)) == f"no space left on device while writing {shard}"
    monkeypatch.setattr(checkpoint_writer, "FULL_BELOW", 0)  # space left: the error is not a full disk
    assert FileSystemWriterAsync.write_preloaded_data([], 0, (shard,), results_queue=None) == (0, short)
    assert write_problem(None, str(tmp_path)) is None


def test_outputs_that_cannot_be_opened_are_one_line(tmp_path, monkeypatch):
    """Issue 36: these were tracebacks (FileNotFoundError, OSError, wandb's UsageError)."""
    import errno

    from bebop_megatron.training import monitor
    from bebop_megatron.training.monitor import Monitor, MonitorError

    def opened(*overrides):
        Monitor(load_config(overrides=[*TINY, f"save.dir={tmp_path / 'ckpt'}", *overrides]), rank=0)

    with pytest.raises(MonitorError) as err:
        opened("logging.tensorboard_dir=/proc/nope/tb")
    assert str(err.value) == "logging.tensorboard_dir=/proc/nope/tb cannot be written (No such file or directory: /proc/nope)"

    def read_only(path, *args, **kwargs):  # a read-only mount (root may write anywhere else)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(monitor, "open", read_only, raising=False)
    with pytest.raises(MonitorError) as err:
        opened(f"logging.metrics_file={tmp_path / 'm.jsonl'}")
    assert str(err.value) == (f"logging.metrics_file={tmp_path / 'm.jsonl'} cannot be written (Read-only file system: "
                              f"{tmp_path / 'm.jsonl'})")
    monkeypatch.undo()
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    with pytest.raises(MonitorError) as err:
        opened("logging.wandb.mode=online")
    assert str(err.value).startswith("logging.wandb.mode=online: wandb refused to start (")
    assert str(err.value).endswith("): set WANDB_API_KEY (or run `wandb login`), or use logging.wandb.mode=offline")
    assert "\n" not in str(err.value)
