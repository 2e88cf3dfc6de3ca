"""Train tiny MTP heads on the frozen backbone's own samples; report held-out acceptance.

    python tests/helpers/training_signal.py --out FILE --losses e2e_tv,ce key=value ...

The paper's setting in miniature: the training data are sequences the frozen backbone
generates itself (temperature 1, as RFT data are the model's own responses), so CE on the
data tokens is a sampled estimate of forward KL to the backbone and the objectives compete
on the same target. The backbone's random initialisation (same seed whatever the loss)
gives the distribution; ``model.init_method_std`` sets how peaked it is.

Each ``loss.type`` of ``--losses`` trains its own head (a new Trainer: the same seed, so the
same backbone and initial head) in this one process. The sequences are sampled once, from the
first Trainer's backbone: sampling is deterministic given the backbone and the seed, and every
later Trainer's backbone is checked bit-identical to it (``same_backbone``), so each would have
sampled exactly these. Writes JSON: per loss type, held-out alpha_RS / alpha_TO / H(p) per MTP
step before training and after ``train.steps`` steps, and the training losses.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from bebop_megatron.config import load_config
from bebop_megatron.data import Batch
from bebop_megatron.model import is_mtp_param
from bebop_megatron.training import Trainer


@torch.no_grad()
def sample_from_backbone(trainer: Trainer, num: int, length: int, seed: int) -> torch.Tensor:
    """``[num, length + 1]`` tokens sampled autoregressively from the backbone (temperature 1).

    Token t + 1 comes from the last position of a forward over the prefix ``seqs[:, :t + 1]``:
    attention is causal, so position t's hidden state does not depend on later tokens, and the
    prefix costs about half of a full-length forward on average."""
    model = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
    vocab = trainer.cfg.model.vocab_size
    g = torch.Generator().manual_seed(seed)
    seqs = torch.zeros(num, length + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, vocab, (num,), generator=g)
    positions = torch.arange(length).expand(num, length)
    mtp_process, model.mtp_process = model.mtp_process, False  # the backbone's hidden states only
    try:
        for t in range(length):
            backbone_SBH = model(seqs[:, : t + 1], positions[:, : t + 1], None)
            logits = backbone_SBH[t] @ model.output_layer.weight.t()
            probs = torch.softmax(logits[:, :vocab].float(), -1)  # padded vocabulary entries excluded
            seqs[:, t + 1] = torch.multinomial(probs, 1, generator=g)[:, 0]
    finally:
        model.mtp_process = mtp_process
    return seqs


def batches_of(seqs: torch.Tensor, micro: int, first_id: int) -> list[Batch]:
    out = []
    for i in range(0, seqs.shape[0], micro):
        chunk = seqs[i : i + micro]
        B, S = chunk.shape[0], chunk.shape[1] - 1
        out.append(Batch(
            tokens=chunk[:, :-1].contiguous(), labels=chunk[:, 1:].contiguous(), loss_mask=torch.ones(B, S),
            position_ids=torch.arange(S).expand(B, S).contiguous(),
            sample_ids=torch.arange(first_id + i, first_id + i + B), segment_ids=torch.zeros(B, S, dtype=torch.long),
        ))
    return out


def backbone_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    module = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
    return {n: p.detach().clone() for n, p in module.named_parameters() if not is_mtp_param(n)}


def train_and_measure(trainer: Trainer, train: list[Batch], heldout: list[Batch]) -> dict:
    cfg = trainer.cfg
    per_step = cfg.train.global_batch_size // cfg.train.micro_batch_size
    before = trainer.evaluate(heldout)
    losses = []
    for step in range(cfg.train.steps):
        first = (step * per_step) % len(train)
        metrics = trainer.train_step([train[(first + j) % len(train)] for j in range(per_step)])
        losses.append(metrics.loss)
    after = trainer.evaluate(heldout)
    return {
        "loss_type": cfg.loss.type, "losses": losses,
        "before": {"alpha_rs": before.alpha_rs, "alpha_to": before.alpha_to, "entropy_target": before.entropy_target},
        "after": {"alpha_rs": after.alpha_rs, "alpha_to": after.alpha_to, "entropy_target": after.entropy_target,
                  "entropy_draft": after.entropy_draft},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--losses", required=True, help="comma-separated loss.type values, each trained in turn")
    parser.add_argument("--train-samples", type=int, default=512)
    parser.add_argument("--heldout-samples", type=int, default=128)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results, data, reference = {"same_backbone": True}, None, None
    for loss_type in args.losses.split(","):
        trainer = Trainer(load_config(overrides=[*args.overrides, f"loss.type={loss_type}"]), log=lambda *a, **k: None)
        backbone = backbone_of(trainer)
        if data is None:
            S, micro = trainer.cfg.train.seq_length, trainer.cfg.train.micro_batch_size
            train = batches_of(sample_from_backbone(trainer, args.train_samples, S, seed=1), micro, 0)
            heldout = batches_of(sample_from_backbone(trainer, args.heldout_samples, S, seed=2), micro, 10**6)
            data, reference = (train, heldout), backbone
        results["same_backbone"] &= backbone.keys() == reference.keys() and all(
            torch.equal(backbone[n], reference[n]) for n in reference)
        results[loss_type] = train_and_measure(trainer, *data)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main()
