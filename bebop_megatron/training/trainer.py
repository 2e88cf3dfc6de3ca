"""The MTP training loop: frozen backbone, Megatron schedules, optimizer and checkpoints.

Usage (``examples/pretrain_mtp.py`` is a thin wrapper)::

    trainer = Trainer(cfg)
    history = trainer.train()
"""

from __future__ import annotations

import functools
import math
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from bebop_megatron import launcher
from bebop_megatron.config import Config, ConfigError, parallel_sizes, to_yaml
from bebop_megatron.data import (
    attention_mask,
    batch_iterator,
    build_train_dataset,
    build_valid_dataset,
    check_trainable,
    eval_batches,
    load_tokenizer,
)
from bebop_megatron.model import build_model
from bebop_megatron.model.builder import use_transformer_engine
from bebop_megatron.model.mtp_init import init_mtp_layers
from bebop_megatron.model.mtp_init import resolve as resolve_mtp_init
from bebop_megatron.platform import init_distributed, resolve_device
from bebop_megatron.platform.lazy_imports import use_deterministic_algorithms
from bebop_megatron.platform.grad_norms import compute_grad_norms, step_with_norms
from bebop_megatron.training import checkpoint as ckpt
from bebop_megatron.training.model_weights import load_model_weights
from bebop_megatron.training import synthetic_backbone
from bebop_megatron.training.flops import mfu, peak_tflops_per_device, step_flops
from bebop_megatron.training.guard import NumericsGuard, agree_on_flags, local_loss_is_finite
from bebop_megatron.training.loss import mtp_loss
from bebop_megatron.training.monitor import Monitor, eval_scalars, peak_memory_gib, step_scalars
from bebop_megatron.training.optim import build_optimizer, finalize_mtp_grads, wrap_ddp
from bebop_megatron.training.parallel import setup_parallel
from bebop_megatron.model.cp_attention import shard_sequence
from bebop_megatron.training.precision import check_cpu_bf16
from bebop_megatron.training.resume import agree_on_start
from bebop_megatron.training.schedule import run_microbatches
from bebop_megatron.training.signals import (
    INTERRUPT_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    Preempted,
    PreemptionHandler,
    stop_message,
)
from bebop_megatron.training.step_metrics import (
    StepMetrics,
    count_parameters,
    eval_line,
    reduce_step_metrics,
    step_line,
)


def _forward_step(data_iterator, model, *, num_steps: int, device: torch.device, loss_cfg, vocab_size: int,
                  decode_exact: bool = False):
    batch = next(data_iterator)
    # Packed rows: causal attention within each document (None: plain causal). Rotary
    # embeddings are relative, so the row's running positions give each document the same
    # attention scores as positions restarting at 0.
    mask = attention_mask(batch.segment_ids)
    batch = batch.to(device)
    # Context parallelism: the model gets this rank's chunks of the rows (the attention the whole
    # rows' document starts), the loss whole rows (model/cp_attention.py, training/loss.py).
    cp_size = parallel_state.get_context_parallel_world_size()
    inputs = [batch.tokens, batch.position_ids]
    if cp_size > 1:
        inputs = [shard_sequence(x, parallel_state.get_context_parallel_rank(), cp_size) for x in inputs]
    output = model(*inputs, None if mask is None else mask.to(device))
    unwrapped = getattr(model, "module", model)
    if not unwrapped.post_process:
        return output, None

    def loss_func(hidden):
        loss_sum, count, stats = mtp_loss(
            unwrapped, hidden, batch, num_steps, parallel_state.get_tensor_model_parallel_group(), loss_cfg,
            vocab_size=vocab_size, decode_exact=decode_exact,
        )
        return loss_sum, count, {"loss_sum": loss_sum.detach(), "count": count, "stats": stats}

    return output, loss_func


def check_packing(cfg: Config, use_te: bool) -> None:
    """Packed rows need the per-document attention mask, which only the local layers take."""
    if (cfg.data.train_files or cfg.data.valid_files) and cfg.data.pack and use_te:
        raise ConfigError(
            "data.pack=true needs a per-document attention mask, which the Transformer Engine layers "
            "do not take yet (packed THD sequences are not implemented): set data.pack=false "
            "(one document per row) or model.transformer_impl=local"
        )


class Trainer:
    """Builds everything from a validated :class:`Config`; ``train()`` runs the loop."""

    def __init__(self, cfg: Config, log=print):
        self.cfg = cfg
        # Every size check runs before a process group exists (torchrun sets WORLD_SIZE).
        parallel_sizes(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.device = resolve_device(cfg.device)
        if cfg.precision == "fp8":
            from bebop_megatron.training.precision import check_fp8_available

            check_fp8_available(self.device, cfg.fp8.recipe)
        check_cpu_bf16(self.device, cfg.precision)
        if cfg.train.deterministic and self.device == "cpu":
            use_deterministic_algorithms(warn_only=True)
        self.rank, self.world = init_distributed(self.device)
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        self._comm_device = torch.device("cuda") if self.device == "cuda" else torch.device("cpu")
        # model.backbone_init=fit_synthetic: the cached fitted backbone becomes backbone_checkpoint
        # (fitted first by rank 0 if missing), before the start plan fingerprints the backbone.
        synthetic_backbone.prepare(cfg, self.rank, self.log)
        # Rank 0 takes the save.dir lock and picks the checkpoint (comparing its config) before
        # anything is built or written; every rank gets the same plan or the same error.
        self.start_plan = agree_on_start(cfg, self.rank)
        for notice in self.start_plan.notices:
            self.log(notice)
        self.monitor = Monitor(cfg, self.rank, self.log)  # TensorBoard / wandb on rank 0
        self.preemption = PreemptionHandler(interrupt_notice=self._interrupt_notice()).install()
        self.stop_requested = False  # all ranks agree on it at each optimizer step
        self.stop_preempted = False  # ... and on why: SIGTERM / SIGUSR1 on some rank (requeue) ...
        self.stop_interrupted = False  # ... or only Ctrl-C (SIGINT)
        self.guard = NumericsGuard(cfg.train.max_skipped_steps)
        self.async_saver = ckpt.AsyncSaver() if cfg.save.async_save and cfg.save.dir else None
        self.flops = step_flops(cfg)
        self.peak_tflops = peak_tflops_per_device(self.device, cfg.precision, cfg.logging.peak_tflops)
        real_data = bool(cfg.data.train_files or cfg.data.valid_files)
        check_packing(cfg, use_transformer_engine(cfg, self.device))
        # Data first: a bad input line stops the run before any model is built.
        tokenizer = load_tokenizer(cfg) if real_data else None
        self.dataset = build_train_dataset(cfg, tokenizer=tokenizer, log=self.log, progress=self.rank == 0)
        self.valid_dataset = build_valid_dataset(cfg, tokenizer=tokenizer, log=self.log, progress=self.rank == 0)
        check_trainable(self.dataset, "data.train_files")  # before the model: a run on nothing is refused
        if self.valid_dataset is not None:
            check_trainable(self.valid_dataset, "data.valid_files")
        self.sizes = setup_parallel(cfg, self.world)
        self.model = build_model(cfg, self.device)
        if cfg.model.backbone_checkpoint:
            load_model_weights(cfg.model.backbone_checkpoint, self.model, backbone_only=True)
        elif cfg.model.init_checkpoint:
            load_model_weights(cfg.model.init_checkpoint, self.model, backbone_only=False)
        init_mtp_layers(self.model, resolve_mtp_init(cfg), parallel_state.get_tensor_model_parallel_rank())
        self.has_mtp = bool(self.model.mtp_process)
        # Every stage builds the (DDP, optimizer) pair because Megatron aligns param groups
        # across all ranks; on backbone-only stages both are empty and do no communication.
        self.model = wrap_ddp(cfg, self.model)
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model)
        self.model.config.no_sync_func = self.model.no_sync
        self.model.config.finalize_model_grads_func = finalize_mtp_grads
        self.model.config.grad_scale_func = self.optimizer.scale_loss
        self.step = 0
        self.eval_history: list[StepMetrics] = []
        self.consumed_samples = 0
        self._maybe_resume()

    # ---------------------------------------------------------------- resume

    def _layout(self) -> dict:
        p = self.cfg.parallel
        return {"world": self.world, "tp": p.tensor, "pp": p.pipeline, "ep": p.expert}

    def _maybe_resume(self) -> None:
        path = self.start_plan.resume_path  # checked by rank 0: complete, intact, same model and data
        if path is None:
            return
        common = ckpt.read_common_state(path)
        # RNG streams are per rank: they only mean something under the same layout.
        try:
            ckpt.load_training_checkpoint(
                path, self.model, self.optimizer, restore_rng=common.get("layout") == self._layout()
            )
        except (ValueError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # torch's CheckpointException (a BaseException), a damaged shard, ...
            failures = getattr(err, "failures", None)
            if failures:  # {rank: (exception, traceback)}: the first one says what went wrong
                err = next(iter(failures.values()))[0]
            reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
            raise ValueError(f"cannot load checkpoint {path}: {type(err).__name__}: {reason}") from None
        self.step = common["step"]
        self.consumed_samples = common["consumed_samples"]
        self.guard.total = common.get("skipped_steps", 0)
        self.scheduler.step(increment=self.step)
        self.log(f"resumed from {path} at step {self.step} (samples consumed: {self.consumed_samples})")

    def save(self) -> str:
        """Write a training checkpoint (collective); returns its final path. With
        ``save.async_save`` it appears there once the background write is published."""
        common = {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "layout": self._layout(),
            "config_yaml": to_yaml(self.cfg),
            "skipped_steps": self.guard.total,
            **self.start_plan.records(),  # checked on resume (and the backbone by tools/convert_to_hf.py)
        }
        return ckpt.save_training_checkpoint(
            self.cfg.save.dir, self.step, self.model, self.optimizer, common,
            keep_last=self.cfg.save.keep_last, async_saver=self.async_saver,
        )

    # ---------------------------------------------------------------- step

    def forward_step_func(self, decode_exact: bool = False):
        """Megatron's ``forward_step_func`` of this model and loss, what a pipeline schedule calls per
        micro-batch (``forward_backward`` runs it; so can another schedule, e.g. a benchmark's stock 1F1B)."""
        return functools.partial(_forward_step, num_steps=self.cfg.mtp.num_steps, device=self._comm_device,
                                 loss_cfg=self.cfg.loss, vocab_size=self.cfg.model.vocab_size,
                                 decode_exact=decode_exact)

    def forward_backward(self, micro_batches, force_all_reduce: bool = False, forward_only: bool = False,
                         decode_exact: bool = False) -> list:
        """Zero grads, then forward/backward over the step's micro-batches (grads finalized).

        ``force_all_reduce`` leaves the full gradient on every rank also with the
        distributed optimizer (which otherwise reduce-scatters). ``forward_only``: the
        loss and statistics only, gradients untouched. ``decode_exact``: also the decode-exact
        forecast's sums (the held-out pass).
        """
        if not forward_only:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        return run_microbatches(
            forward_step_func=self.forward_step_func(decode_exact=decode_exact),
            data_iterator=iter(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=self.cfg.train.seq_length,
            micro_batch_size=self.cfg.train.micro_batch_size,
            has_mtp=self.has_mtp,
            force_all_reduce=force_all_reduce,
            forward_only=forward_only,
        )

    def evaluate(self, micro_batches) -> StepMetrics:
        """Loss and acceptance statistics of held-out micro-batches (forward only, no update)."""
        with torch.no_grad():
            outputs = self.forward_backward(micro_batches, forward_only=True)
        return self.reduce_metrics(outputs, torch.tensor(0.0))

    def evaluate_valid(self) -> StepMetrics | None:
        """One pass over ``data.valid_files`` (``eval.max_samples`` rows; 0 = all), every row
        once; None without validation data."""
        if self.valid_dataset is None:
            return None
        cfg = self.cfg
        num_rows = len(self.valid_dataset)
        if cfg.eval.max_samples:
            num_rows = min(num_rows, cfg.eval.max_samples)
        outputs = []
        with torch.no_grad():
            for micro_batches in eval_batches(
                self.valid_dataset, num_rows=num_rows, global_batch_size=cfg.train.global_batch_size,
                micro_batch_size=cfg.train.micro_batch_size,
                dp_rank=parallel_state.get_data_parallel_rank(),
                dp_size=parallel_state.get_data_parallel_world_size(),
            ):
                outputs += self.forward_backward(micro_batches, forward_only=True, decode_exact=True)
        metrics = self.reduce_metrics(outputs, torch.tensor(0.0))
        metrics.extra["rows"] = num_rows
        return metrics

    def optimizer_step(self, outputs: list = ()) -> torch.Tensor:
        """Clip, update and advance the LR schedule; returns the global grad norm.

        Numerics guard (:mod:`~bebop_megatron.training.guard`): the global grad norm (all
        trainable gradients, Megatron's separate grad-norm groups included) is computed first,
        and if it or a loss in ``outputs`` is not finite on any rank the update is skipped
        (``self.last_step_skipped``); the schedule advances either way. Megatron's step then
        clips with that same norm instead of reducing the gradients a second time
        (:mod:`bebop_megatron.platform.grad_norms`). The same all-reduce agrees on a pending
        preemption signal (``self.stop_requested``). Backbone-only stages own no trainable
        parameter: they skip the optimizer (and its grad-norm reduction) entirely and only
        advance the schedule.
        """
        norms = None
        bad = False
        if self.has_mtp:
            norms = compute_grad_norms(self.optimizer)
            bad = norms.found_inf or not (math.isfinite(norms.total) and local_loss_is_finite(outputs))
        bad, preempted, interrupted = agree_on_flags(
            bad, self.preemption.preempted is not None, self.preemption.interrupted, device=self._comm_device)
        self.stop_preempted |= preempted
        self.stop_interrupted |= interrupted
        self.stop_requested |= preempted or interrupted
        self.last_step_skipped = bad
        if self.has_mtp and not bad:
            step_with_norms(self.optimizer, norms)
        self.scheduler.step(increment=1)
        return torch.tensor(norms.total if norms is not None else 0.0)

    def current_lr(self) -> float:
        """The LR the next update uses (the scheduler has set it for the step to come)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, micro_batches) -> StepMetrics:
        outputs = self.forward_backward(micro_batches)
        lr = self.current_lr()  # read before optimizer_step advances the schedule: the LR this update uses
        grad_norm = self.optimizer_step(outputs)
        self.step += 1
        self.consumed_samples += self.cfg.train.global_batch_size
        metrics = self.reduce_metrics(outputs, grad_norm, lr=lr)
        metrics.extra["skipped"] = self.last_step_skipped
        if self.last_step_skipped:
            self.log(f"step {self.step}: non-finite loss or gradient, update skipped "
                     f"({self.guard.consecutive + 1} in a row, {self.guard.total + 1} in all)")
        self.guard.record(self.last_step_skipped, self.step)  # raises after too many in a row
        return metrics

    def reduce_metrics(self, outputs: list, grad_norm: torch.Tensor, lr: float | None = None) -> StepMetrics:
        """One all-reduce per step brings the logged numbers to every rank
        (:func:`~bebop_megatron.training.step_metrics.reduce_step_metrics`). ``lr``: the LR
        the step's update used (default: the next update's, for evaluations).
        """
        return reduce_step_metrics(
            outputs, grad_norm, num_steps=self.cfg.mtp.num_steps, has_mtp=self.has_mtp,
            comm_device=self._comm_device, step=self.step, lr=self.current_lr() if lr is None else lr,
        )

    # ---------------------------------------------------------------- loop

    def batches(self):
        return batch_iterator(
            self.dataset,
            start_sample=self.consumed_samples,
            global_batch_size=self.cfg.train.global_batch_size,
            micro_batch_size=self.cfg.train.micro_batch_size,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
        )

    def train(self) -> list[StepMetrics]:
        cfg = self.cfg
        self.log(f"resolved config:\n{to_yaml(cfg)}")
        self.monitor.text("config", to_yaml(cfg))
        self.log(self.summary())
        history: list[StepMetrics] = []
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_length
        data = self.batches()
        start = time.perf_counter()
        self._loop_start_step = self.step  # the ETA divides this process's time by its own steps
        if self.step >= cfg.train.steps:
            self.log(f"already at step {self.step} of train.steps={cfg.train.steps}: nothing to train")
            return history
        while self.step < cfg.train.steps:
            t0 = time.perf_counter()
            metrics = self.train_step(next(data))
            seconds = max(time.perf_counter() - t0, 1e-9)
            metrics.tokens_per_s = tokens_per_step / seconds
            metrics.extra["mfu"] = mfu(self.flops["total"], seconds, self.world, self.peak_tflops)
            metrics.extra["peak_mem_gib"] = peak_memory_gib(self.device)
            self.monitor.scalars(metrics.step, step_scalars(
                metrics, metrics.extra["mfu"], metrics.extra["peak_mem_gib"], self.guard.total))
            history.append(metrics)
            if metrics.step % cfg.train.log_interval == 0 or metrics.step == cfg.train.steps:
                self.log(self.format(metrics, time.perf_counter() - start))
            if self.valid_dataset is not None and (
                metrics.step == cfg.train.steps or (cfg.eval.interval and metrics.step % cfg.eval.interval == 0)
            ):
                t_eval = time.perf_counter()
                result = self.evaluate_valid()
                self.eval_history.append(result)
                self.monitor.scalars(metrics.step, eval_scalars(result))
                self.log(self.format_eval(result, time.perf_counter() - t_eval))
            saved = bool(cfg.save.dir and cfg.save.interval and metrics.step % cfg.save.interval == 0)
            if saved:
                self.log(f"{'saving (async)' if self.async_saver else 'saved'} {self.save()}")
            if self.async_saver is not None:
                self.async_saver.poll()
            if self.stop_requested:
                self._exit_for_requeue(saved)
        if cfg.save.dir and (not cfg.save.interval or self.step % cfg.save.interval):
            self.log(f"{'saving (async)' if self.async_saver else 'saved'} {self.save()}")
        if self.async_saver is not None:
            self.async_saver.close()
        self.monitor.close()
        self.preemption.uninstall()  # Ctrl-C is the caller's again
        return history

    def _interrupt_notice(self) -> str:
        """Rank 0's line at the first Ctrl-C (every rank gets it under torchrun)."""
        if self.rank != 0:
            return ""
        what = "saving a checkpoint" if self.cfg.save.dir else "stopping (save.dir is null: no checkpoint)"
        return (f"Ctrl-C: {what} when this training step ends, then exiting with {INTERRUPT_EXIT_CODE} "
                "(Ctrl-C again stops at once, without it)")

    def _exit_for_requeue(self, saved: bool) -> None:
        """Preemption (SIGTERM / SIGUSR1): save a complete checkpoint, exit with 75; Ctrl-C
        (SIGINT, no preemption signal on any rank): the same, exit with 130."""
        path = os.path.join(self.cfg.save.dir, f"iter_{self.step:07d}") if saved else None
        if self.cfg.save.dir and not saved:
            path = self.save()
        if self.async_saver is not None:
            self.async_saver.close()
        gone = launcher.gone()
        interrupted = self.stop_interrupted and not self.stop_preempted and gone is None
        # a preemption's line names this rank's preemption signal (None: it reached another rank)
        received = "SIGINT" if interrupted else self.preemption.preempted
        message = stop_message(received, path, self.step, gone, interrupted=interrupted)
        self.log(message)
        self.monitor.close()
        raise Preempted(message, INTERRUPT_EXIT_CODE if interrupted else REQUEUE_EXIT_CODE)

    def format(self, m: StepMetrics, elapsed: float) -> str:
        return step_line(m, elapsed, steps=self.cfg.train.steps, loss_type=self.cfg.loss.type,
                         skipped_total=self.guard.total, start_step=getattr(self, "_loop_start_step", 0))

    def format_eval(self, m: StepMetrics, seconds: float) -> str:
        return eval_line(m, seconds, loss_type=self.cfg.loss.type)

    def summary(self) -> str:
        total, trainable = count_parameters(self.model)
        counts = torch.tensor([total, trainable], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(counts)
        c, p = self.cfg, self.cfg.parallel
        frozen = "backbone frozen" if c.model.freeze_backbone else "backbone TRAINABLE"
        return (
            f"bebop_megatron: device={self.device} world={self.world} TP={p.tensor} CP={p.context} PP={p.pipeline} "
            f"EP={p.expert} SP={p.sequence_parallel} DP={self.sizes['data']} | "
            f"params {counts[0]:,.0f} (trainable {counts[1]:,.0f}, {frozen}) | "
            f"K={c.mtp.num_steps} MTP steps over {c.mtp.num_layers} layer(s) | loss {c.loss.type}"
        )

