"""Run a few training steps and record what the layout tests compare.

    torchrun --nproc_per_node 2 tests/helpers/run_case.py --out DIR [--save-model PATH] key=value ...
    python tests/helpers/run_case.py --out DIR ...          (the single-rank reference)
    torchrun --nproc_per_node 2 tests/helpers/run_case.py --cases cases.json

``--cases``: a JSON list of ``{"out": DIR, "overrides": [...], "save_model": PATH or null}``,
run one after the other in this launch (each builds its own process groups, model and
optimizer), which saves the start-up of a launch per case. A case with ``"alone": true`` is a
single-process run: under torchrun the ranks share those out (each runs its share by itself,
in a process group of its own: tests/helpers/cli_batch.py ``world_of_one``), and every rank
waits for all of them before its next case.

Writes (rank 0) ``DIR/result.json``: per-step loss / top-1 / grad norm, whether every
backbone parameter is bit-identical after training, and the optimizer's parameter count
against the trainable (MTP) parameter count; with ``data.valid_files``, ``valid``: the held-out
pass's metrics after the last step. Writes ``DIR/grads0`` (all ranks): the MTP
gradients of step 0 as a Megatron distributed checkpoint, so that any layout's gradients
load back as full, unsharded tensors for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bebop_megatron.config import load_config  # first: it quiets Megatron's start-up notices
from megatron.core import dist_checkpointing
from bebop_megatron.model import is_mtp_param
from megatron.core import parallel_state
from bebop_megatron.training import Trainer
from bebop_megatron.training.model_weights import (
    filtered_sharded_state_dict,
    save_model_checkpoint,
    use_in_process_write_results,
)


VALID_KEYS = ("loss", "top1", "alpha_rs", "alpha_to", "accept_len_rs", "accept_len_to", "accept_len_decode_rs",
              "accept_len_decode_to", "kl")


def save_mtp_grads(path: str, trainer: Trainer) -> None:
    module = trainer.model.module
    params = dict(module.named_parameters())
    sd = {k: v for k, v in filtered_sharded_state_dict(trainer.model, is_mtp_param).items() if k in params}
    for name, sharded in sd.items():
        sharded.data = params[name].main_grad.detach().clone()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    use_in_process_write_results()
    dist_checkpointing.save({"grads": sd} if sd else {}, path)
    dist.barrier()


def optimizer_params(optimizer) -> list[torch.nn.Parameter]:
    """The model parameters this rank's optimizer updates (its shard's, when distributed)."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    out = []
    for opt in chained:
        if hasattr(opt, "model_fp32_groups"):  # distributed optimizer: updates shards of these
            for group in opt.model_float16_groups + opt.model_fp32_groups:
                out.extend(group)
        else:
            for group in opt.param_groups:
                out.extend(group["params"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--save-model", default=None, help="write the initial full model here first")
    parser.add_argument("--cases", default=None, help="JSON list of cases instead of --out/overrides")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.cases:
        with open(args.cases) as f:
            cases = json.load(f)
    else:
        cases = [{"out": args.out, "overrides": args.overrides, "save_model": args.save_model}]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    alone = [i for i, case in enumerate(cases) if case.get("alone") and world > 1]
    for i, case in enumerate(cases):
        if i in alone:
            if alone.index(i) % world == rank:
                sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
                from tests.helpers.cli_batch import world_of_one

                with world_of_one():
                    run_case(case["out"], case["overrides"], case.get("save_model"))
                (Path(case["out"]) / "alone.done").write_text("done")
            continue
        for j in alone:  # the single-process runs before this case are complete
            while j < i and not (Path(cases[j]["out"]) / "alone.done").exists():
                time.sleep(0.05)
        run_case(case["out"], case["overrides"], case.get("save_model"))


def run_case(out: str, overrides: list[str], save_model: str | None) -> None:
    cfg = load_config(overrides=["save.dir=null", "train.resume=none", *overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    if save_model:
        save_model_checkpoint(save_model, trainer.model)

    module = trainer.model.module
    backbone = {n: p.detach().clone() for n, p in module.named_parameters() if not is_mtp_param(n)}
    data = trainer.batches()
    history = []
    for step in range(cfg.train.steps):
        batches = next(data)
        # Step 0 all-reduces (not reduce-scatters) so that the distributed optimizer's
        # ranks each hold the full gradient for the comparison; the update is the same.
        outputs = trainer.forward_backward(batches, force_all_reduce=step == 0)
        if step == 0:
            save_mtp_grads(os.path.join(out, "grads0"), trainer)
        norm = trainer.optimizer_step()
        trainer.step += 1
        trainer.consumed_samples += cfg.train.global_batch_size
        m = trainer.reduce_metrics(outputs, norm)
        history.append({"loss": m.loss, "top1": m.top1, "ce": m.ce, "grad_norm": m.grad_norm,
                        "alpha_rs": m.alpha_rs, "alpha_to": m.alpha_to, "accept_len_rs": m.accept_len_rs})

    valid = trainer.evaluate_valid()  # None without data.valid_files
    # Backbone bit-identical on every rank; optimizer holds exactly the trainable params.
    identical = all(torch.equal(p, backbone[n]) for n, p in module.named_parameters() if n in backbone)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = optimizer_params(trainer.optimizer)
    opt_ids = {id(p) for p in opt}
    # Every trainable parameter is updated by some data-parallel rank (all of them on every
    # rank unless the optimizer is distributed, which shards over DP x CP), and nothing else is.
    covered = torch.tensor([float(id(p) in opt_ids) for p in trainable])
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(covered, op=dist.ReduceOp.MAX, group=dp_cp_group)
    counts = torch.tensor(
        [
            float(identical),
            float(bool(covered.all()) and opt_ids <= {id(p) for p in trainable}),
            float(all(is_mtp_param(n) for n, p in module.named_parameters() if id(p) in opt_ids)),
            float(sum(p.numel() for p in opt)),
            float(sum(p.numel() for p in trainable)),
        ],
        dtype=torch.float64,
    )
    flags = counts[:3].clone()
    summary = trainer.summary()  # the start-up line (a collective: every rank)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        result = {
            "history": history,
            "backbone_identical": bool(flags[0]),
            "optimizer_updates_exactly_trainable": bool(flags[1]),
            "optimizer_params_all_mtp": bool(flags[2]),
            "rank0_optimizer_numel": int(counts[3]),
            "rank0_trainable_numel": int(counts[4]),
            "world_size": dist.get_world_size(),
            "summary": summary,
            "layout": {"tensor": parallel_state.get_tensor_model_parallel_world_size(),
                       "context": parallel_state.get_context_parallel_world_size(),
                       "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
                       "expert": parallel_state.get_expert_model_parallel_world_size(),
                       "data": parallel_state.get_data_parallel_world_size(),
                       "sequence_parallel": bool(module.config.sequence_parallel)},
        }
        if valid is not None:
            result["valid"] = {key: getattr(valid, key) for key in VALID_KEYS}
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
