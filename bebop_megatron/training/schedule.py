"""Forward-backward over the micro-batches of one step, exploiting the frozen backbone.

PP = 1: Megatron's ``forward_backward_no_pipelining`` (gradient accumulation with
``no_sync``, per-token loss normalisation, ``finalize_model_grads_func``).

PP > 1: a forward-only pipeline over the backbone stages feeding the last stage, which
holds the MTP block and runs the MTP forward/backward of each micro-batch as it arrives.
The stock 1F1B schedule is not used on purpose: with a frozen backbone the MTP stage has
no input gradient to send back, so 1F1B's backward receives on earlier stages would wait
forever, and even when they do not, they run a backbone backward that changes nothing.
Here nothing is ever sent backwards, backbone-only stages run under ``torch.no_grad``, and
their only work per micro-batch is one forward and one send. Megatron's
``forward_step``/``backward_step`` and ``P2PCommunicator`` do the per-micro-batch work.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    forward_backward_no_pipelining,
    forward_step,
)
from megatron.core.utils import get_attr_wrapped_model


def run_microbatches(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    has_mtp: bool,
    force_all_reduce: bool = False,
    forward_only: bool = False,
) -> list:
    """Returns the loss functions' per-micro-batch outputs (empty on backbone-only stages).

    ``force_all_reduce``: all-reduce gradients even with the distributed optimizer, so that
    every rank holds the full gradient (for inspection and tests). ``forward_only``:
    evaluation, no backward (the caller runs it under ``torch.no_grad``).
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=[model],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            force_all_reduce=force_all_reduce,
        )
    return _frozen_backbone_pipeline(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        has_mtp=has_mtp,
        force_all_reduce=force_all_reduce,
        forward_only=forward_only,
    )


def _frozen_backbone_pipeline(*, forward_step_func, data_iterator, model, num_microbatches,
                              seq_length, micro_batch_size, has_mtp, force_all_reduce, forward_only) -> list:
    config = model.config
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    p2p = P2PCommunicator(pp_group=pp_group, config=config)
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if has_mtp != last:
        raise ValueError(
            "parallel.pipeline_layout must place the MTP layers ('m') on the last pipeline stage, "
            "together with the loss ('L')"
        )
    # The hidden states a stage sends: this CP rank's chunks of the rows (2 * seq_length / (2C)),
    # and of those this TP rank's shard under sequence parallelism.
    tp = parallel_state.get_tensor_model_parallel_world_size()
    s_local = seq_length // parallel_state.get_context_parallel_world_size()
    s_local = s_local // tp if config.sequence_parallel else s_local
    shape = (s_local, micro_batch_size, config.hidden_size)

    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")  # CPU mode maps it to cpu
    no_sync = config.no_sync_func or contextlib.nullcontext
    for i in range(num_microbatches):
        received = p2p.recv_forward(shape, is_first_stage=first)
        # The backbone is frozen: its activations never need a gradient.
        input_tensor = received.detach() if received is not None else None
        if not last:
            with torch.no_grad():
                get_attr_wrapped_model(model, "set_input_tensor")([input_tensor])
                output, _ = forward_step_func(data_iterator, model)
            p2p.send_forward(output, is_last_stage=False)
            continue
        sync = contextlib.nullcontext if i == num_microbatches - 1 else no_sync
        with sync():
            output, num_tokens = forward_step(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                input_tensor,
                forward_data_store,
                config,
                parallel_state.get_context_parallel_world_size(),
                is_first_microbatch=i == 0,
                current_microbatch=i,
                is_last_stage=True,
            )
            if not forward_only:
                backward_step(None, output, None, config)
        total_num_tokens += num_tokens
    if last and not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            [model],
            total_num_tokens if config.calculate_per_token_loss else None,
            force_all_reduce=force_all_reduce,
        )
    return forward_data_store
