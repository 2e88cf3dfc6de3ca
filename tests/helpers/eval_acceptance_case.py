"""The wiring of ``tools/eval_acceptance.py`` against the training loss's statistics.

    python tests/helpers/eval_acceptance_case.py --checkpoint DIR --data FILE --out FILE

Loads the checkpoint the way the tool does, runs the tool's per-micro-batch statistics
(T=1) on the first micro-batches of the held-out data, and compares alpha_RS, alpha_TO,
top-1, H(p), H(q), KL, the positions per step and the decode-exact sums (expected accepted
drafts and verifications, RS and TO, every gamma) with ``training.loss.mtp_loss`` (the fused
objective the trainer logs, ``decode_exact=True`` as in its held-out pass) on the same
batches. Writes ``{errors, count}`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    sys.path.insert(0, str(TOOLS))  # the tool's own argument parsing
    import eval_acceptance as tool


    from megatron.core import parallel_state

    from bebop_megatron.config import LossConfig
    from bebop_megatron.data import attention_mask, build_valid_dataset, make_batch
    from bebop_megatron.evaluate.options import resolve_checkpoint
    from bebop_megatron.evaluate.run import eval_config
    from bebop_megatron.evaluate.statistics import micro_batch_statistics
    from bebop_megatron.metrics.report import SUM_KEYS, AcceptanceReport
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.loss import STAT_ROWS, mtp_loss
    from bebop_megatron.training.checkpoint import load_trained_model
    from bebop_megatron.training.parallel import setup_parallel

    args = tool.parse_args(["--checkpoint", cli.checkpoint, "--data", cli.data, "--device", "cpu",
                            "--chunk-positions", "50"])
    path = resolve_checkpoint(args.checkpoint)
    _, world = init_distributed("cpu")
    cfg = eval_config(path, args, world, "cpu")
    setup_parallel(cfg, world)
    K = cfg.mtp.num_steps
    model = load_trained_model(cfg, path, "cpu")
    dataset = build_valid_dataset(cfg, progress=False, log=lambda *_: None)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    report = AcceptanceReport([1.0], K, K, [0.0, 100.0])
    want = torch.zeros(len(STAT_ROWS), K, dtype=torch.float64)
    for first in (0, 4):
        batch = make_batch(dataset, list(range(first, first + 4)))
        micro_batch_statistics(model, batch, report, SimpleNamespace(chunk_positions=50, sim_trials=1), K=K,
                               tp_group=tp_group, sim_budget=0, generator=None, device=torch.device("cpu"),
                               vocab_size=cfg.model.vocab_size)
        mask = attention_mask(batch.segment_ids)
        with torch.no_grad():
            hidden = model(batch.tokens, batch.position_ids, mask)
            _, _, stats = mtp_loss(model, hidden, batch, K, tp_group, LossConfig(type="e2e_tv"),
                                   vocab_size=cfg.model.vocab_size, decode_exact=True)
        want += stats.double()
    got = dict(zip(SUM_KEYS, report.sums[0]))
    ref = dict(zip(STAT_ROWS, want))
    pairs = {"alpha_rs": "alpha_rs", "alpha_to": "alpha_to", "top1": "top1_correct", "count": "count",
             "entropy_target": "entropy_target", "entropy_draft": "entropy_draft", "kl": "kl"}
    pairs.update({k: k for k in ("accept_len_rs", "accept_len_to") if k in ref})
    errors = {name: float((got[name] - ref[other]).abs().max() / ref[other].abs().max().clamp(min=1e-30))
              for name, other in pairs.items()}
    # The report keeps per-text decode-exact sums [texts, mode, gamma, (accepted, verifications)].
    texts = torch.cat(report.decode[0]).sum(0)
    for m, mode in enumerate(("rs", "to")):
        for c, what in enumerate(("accepted", "verifications")):
            ref_row = ref[f"decode_{what}_{mode}"]
            errors[f"decode_{what}_{mode}"] = float((texts[m, :, c] - ref_row).abs().max()
                                                    / ref_row.abs().max().clamp(min=1e-30))
    with open(cli.out, "w") as f:
        json.dump({"errors": errors, "count": ref["count"].tolist()}, f, indent=1)


if __name__ == "__main__":
    main()
