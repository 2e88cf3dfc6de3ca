"""DDP wrapper, optimizer and LR schedule over the MTP parameters only.

Only the pipeline stage that holds the MTP block has trainable parameters; stages with
backbone layers only get no DDP wrapper, no optimizer and no gradient communication.
Gradient-norm statistics are reduced over that stage's tensor (and expert) groups, never
across the pipeline, so backbone-only stages take no part in the optimizer step.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection

from bebop_megatron.config import Config


def wrap_ddp(cfg: Config, model) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def mtp_stage_groups() -> ProcessGroupCollection:
    """Megatron's groups with the model-parallel ones restricted to this pipeline stage."""
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.mp = parallel_state.get_tensor_model_parallel_group()
    expert_mp = parallel_state.get_expert_tensor_and_model_parallel_group()
    pgs.tp_ep_pp = expert_mp
    pgs.tp_ep_pp_with_egtp_remat = expert_mp
    if not hasattr(pgs, "intra_dist_opt"):
        pgs.intra_dist_opt = parallel_state.get_intra_distributed_optimizer_instance_group()
    return pgs


def build_optimizer(cfg: Config, ddp_model):
    t = cfg.train
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=cfg.precision in ("bf16", "fp8"),
        params_dtype=ddp_model.config.params_dtype,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(
        opt_config, [ddp_model], use_gloo_process_groups=False, pg_collection=mtp_stage_groups()
    )
    warmup = int(round(t.warmup_fraction * t.steps))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr if t.lr_schedule == "cosine" else t.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=t.steps,
        lr_decay_style="cosine" if t.lr_schedule == "cosine" else "constant",
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
    )
    # Step n's update uses the schedule at n (Megatron's convention is n - 1): the warmup's first
    # step trains at lr / warmup, not 0, and a cosine decay reaches min_lr at the last step. The
    # schedule stays a function of the step alone: a resume advances it by the resumed step.
    scheduler.step(increment=1)
    return optimizer, scheduler


def finalize_mtp_grads(
    model_chunks, num_tokens: torch.Tensor | None, pg_collection=None, force_all_reduce: bool = False, **_
):
    """Megatron's ``finalize_model_grads`` restricted to the MTP stage.

    DP all-reduce (or reduce-scatter), the TP all-reduce of sequence-parallel norm grads, and
    the per-token scaling by the global count. No pipeline-group collectives: backbone-only
    stages have no gradients and do not take part. ``force_all_reduce`` gives every rank
    the full gradient also with the distributed optimizer (for inspection).
    """
    config = model_chunks[0].config
    for chunk in model_chunks:
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    _allreduce_non_tensor_model_parallel_grads(
        model_chunks, config, parallel_state.get_tensor_model_parallel_group()
    )
    if num_tokens is not None:
        torch.distributed.all_reduce(
            num_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        scaling = 1.0 / torch.clamp(num_tokens, min=1)
        for chunk in model_chunks:
            chunk.scale_gradients(scaling)
