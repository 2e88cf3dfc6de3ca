"""Packed rows give every document the loss it gets alone (attention never crosses documents).

    python tests/helpers/packed_case.py key=value ...          (1 rank, or under torchrun)

Builds a Trainer on ``data.train_files``, takes the first rows that hold at least two
documents, and evaluates (forward only) the loss sum and statistics of:

- ``packed``: the rows as the data pipeline packs them (per-document attention mask);
- ``separate``: every document of those rows alone in a row of its own (padding after it),
  the sums added up;
- ``unmasked``: the packed rows with the plain causal mask (attention crosses documents),
  to show that the comparison can fail.

Prints one JSON line on rank 0: the three loss sums, counts and per-step alpha_RS sums.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from bebop_megatron.config import load_config
from bebop_megatron.data import Batch
from bebop_megatron.data import make_batch
from bebop_megatron.training import Trainer
from bebop_megatron.training import trainer as trainer_module
from bebop_megatron.training.loss import STAT_ROWS


def alone(batch: Batch, row: int, segment: int) -> Batch:
    """Document ``segment`` of ``batch`` row ``row`` moved to the start of a fresh row."""
    keep = batch.segment_ids[row] == segment
    n = int(keep.sum())
    out = {}
    for name in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids"):
        src = getattr(batch, name)[row]
        fill = {"loss_mask": 0.0, "segment_ids": -1}.get(name, 0)
        dst = torch.full_like(src, fill)
        dst[:n] = src[keep]
        out[name] = dst[None]
    out["segment_ids"][0, :n] = 0
    out["position_ids"][0, :n] = torch.arange(n)
    return Batch(sample_ids=batch.sample_ids[row : row + 1], **out)


def sums(trainer: Trainer, batches: list[Batch]) -> dict:
    with torch.no_grad():
        outputs = trainer.forward_backward(batches, forward_only=True)
    loss = sum(float(o["loss_sum"]) for o in outputs)
    stats = sum(o["stats"] for o in outputs)
    rows = dict(zip(STAT_ROWS, stats))
    return {"loss_sum": loss, "count": rows["count"].tolist(), "alpha_rs": rows["alpha_rs"].tolist(),
            "accept_len_rs": rows["accept_len_rs"].tolist()}


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(overrides=["device=cpu", "save.dir=null", "train.resume=none", "train.micro_batch_size=1",
                                 "train.global_batch_size=1", *(sys.argv[1:] if argv is None else argv)])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    data = trainer.dataset
    rows = [i for i in range(len(data)) if data.row(i)["segment_ids"].max() >= 1][:2]
    assert len(rows) == 2, "need rows with two or more documents"
    packed = [make_batch(data, [i]) for i in rows]
    separate = [alone(b, 0, s) for b in packed for s in range(int(b.segment_ids.max()) + 1)]
    result = {"documents": len(separate), "packed": sums(trainer, packed), "separate": sums(trainer, separate)}
    masked = trainer_module.attention_mask
    trainer_module.attention_mask = lambda segment_ids: None  # plain causal attention
    try:
        result["unmasked"] = sums(trainer, packed)
    finally:  # a later case in the same process (tests/helpers/cli_batch.py) gets the real mask
        trainer_module.attention_mask = masked
    if dist.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
