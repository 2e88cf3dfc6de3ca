"""``model.attention_backend``: fused SDPA against Megatron's unfused attention, same weights.

    python tests/helpers/attention_case.py --out result.json

One process (TP=1, CPU, fp32). Per case, a tiny model is built with ``unfused`` (the reference)
and with ``sdpa``, the second loading the first's weights; both run the same micro-batch
(causal rows, or packed rows: several documents per row and padding) through the backbone and
the MTP block, then the e2e TV MTP loss backward. Writes, per case: the largest difference of
the hidden states (backbone and every MTP step) relative to their largest magnitude, the loss's
relative difference, and per MTP gradient its largest difference relative to its largest
magnitude. ``memory`` cases record the largest tensor (elements) any operation creates in the
forward and backward of a row of ``S_LONG`` tokens, per backend (``S_LONG^2`` shows an S x S one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bebop_megatron.config import load_config  # noqa: E402  (quiets Megatron's notices first)

TINY = ["device=cpu", "save.dir=null", "train.resume=none", "model.num_layers=2", "model.hidden_size=64",
        "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.vocab_size=200", "mtp.num_layers=1", "mtp.num_steps=2", "model.qk_layernorm=true"]
MLA = ["model.family=moe", "model.num_experts=4", "model.num_query_groups=4", "model.multi_latent_attention=true",
       "model.kv_lora_rank=16", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=8",
       "model.q_lora_rank=32", "model.moe_first_dense_layers=1"]
QWEN_HYBRID = ["model.layer_types=[linear_attention,full_attention]", "model.attention_output_gate=true",
               "model.zero_centered_norms=true", "model.kv_channels=16", "model.rotary_percent=0.25",
               "model.linear_key_head_dim=8", "model.linear_value_head_dim=8", "model.linear_num_key_heads=2",
               "model.linear_num_value_heads=4"]
# name -> (overrides, packed rows)
CASES = {
    "causal": ([], False),
    "packed": ([], True),
    "packed_mha": (["model.num_query_groups=4"], True),
    "packed_gqa_4_to_1": (["model.num_query_groups=1"], True),
    "packed_mla": (MLA, True),
    "packed_qwen_hybrid": (QWEN_HYBRID, True),
}
S, B, S_LONG = 48, 2, 1024


def segments(packed: bool, S: int, B: int) -> torch.Tensor:
    """Row 0: documents of 20, 15 and 13 tokens; row 1: 30 and 10 tokens, then 8 of padding."""
    if not packed:
        return torch.zeros(B, S, dtype=torch.int64)
    seg = torch.full((B, S), -1, dtype=torch.int64)
    for row, lengths in enumerate(([20, 15, 13], [30, 10])[:B]):
        start = 0
        for doc, n in enumerate(lengths):
            seg[row, start:start + n] = doc
            start += n
    return seg


def make_batch(packed: bool, S: int, B: int, vocab: int):
    from bebop_megatron.data import Batch

    g = torch.Generator().manual_seed(7)
    seg = segments(packed, S, B)
    pos = torch.zeros(B, S, dtype=torch.int64)  # positions restart at every document, 0 on padding
    for row in range(B):
        for doc in seg[row].unique().tolist():
            where = seg[row] == doc
            pos[row, where] = torch.arange(int(where.sum())) if doc >= 0 else 0
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    return Batch(tokens=tokens, labels=labels, loss_mask=(seg >= 0).float(), position_ids=pos,
                 sample_ids=torch.arange(B), segment_ids=seg)


def build(overrides: list[str], backend: str, state=None):
    from bebop_megatron.model import build_model
    from bebop_megatron.training.parallel import setup_parallel

    cfg = load_config(overrides=[*TINY, *overrides, f"model.attention_backend={backend}"])
    setup_parallel(cfg, 1)
    model = build_model(cfg, "cpu").train()
    if state is not None:
        model.load_state_dict(state)
    return cfg, model


def run(cfg, model, batch, mask=None):
    """Hidden states ``[(1+K)*S, B, H]``, loss sum and MTP gradients of one micro-batch."""
    from megatron.core import parallel_state

    from bebop_megatron.config.schema import LossConfig
    from bebop_megatron.data.batches import attention_mask
    from bebop_megatron.training.loss import mtp_loss

    mask = attention_mask(batch.segment_ids) if mask is None else None if mask.numel() == 0 else mask
    model.zero_grad(set_to_none=True)
    hidden = model(batch.tokens, batch.position_ids, mask)
    loss, _, _ = mtp_loss(model, hidden, batch, cfg.mtp.num_steps, parallel_state.get_tensor_model_parallel_group(),
                          LossConfig(type="e2e_tv"), vocab_size=cfg.model.vocab_size)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return hidden.detach(), float(loss), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare(ref, got) -> dict:
    (h_ref, loss_ref, g_ref), (h_got, loss_got, g_got) = ref, got
    assert set(g_ref) == set(g_got) and g_ref
    return {"hidden": rel(h_got, h_ref), "loss": abs(loss_got - loss_ref) / abs(loss_ref),
            "grads": {n: rel(g_got[n], g_ref[n]) for n in g_ref},
            "grads_zero": [n for n, g in g_ref.items() if not bool(g.abs().max() > 0)]}


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensor(backend: str, packed: bool) -> int:
    cfg, model = build(["model.max_position_embeddings=2048", "model.vocab_size=64", "model.make_vocab_size_divisible_by=64",
                        "loss.chunk_tokens=256"], backend)
    batch = make_batch(packed, S_LONG, 1, cfg.model.vocab_size)
    with LargestTensor() as mode:
        run(cfg, model, batch)
    return mode.numel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from bebop_megatron.data.batches import attention_mask, dense_attention_mask
    from bebop_megatron.model.attention import MLASDPAttention, SDPAttention
    from bebop_megatron.platform import init_distributed

    torch.use_deterministic_algorithms(True, warn_only=True)
    init_distributed("cpu")
    result = {}
    for name, (overrides, packed) in CASES.items():
        cfg, unfused = build(overrides, "unfused")
        _, sdpa = build(overrides, "sdpa", unfused.state_dict())
        kinds = {type(m) for m in sdpa.modules()}
        assert (MLASDPAttention if "multi_latent" in str(overrides) else SDPAttention) in kinds, name
        batch = make_batch(packed, S, B, cfg.model.vocab_size)
        ref = run(cfg, unfused, batch)
        result[name] = compare(ref, run(cfg, sdpa, batch))
        if name == "packed":  # a caller's own [B, 1, S, S] mask gives SDPA the same attention
            result["packed_dense_mask"] = compare(ref, run(cfg, sdpa, batch, dense_attention_mask(
                attention_mask(batch.segment_ids))))
            # Attention across documents (plain causal): the comparison can fail.
            result["packed_rows_as_causal"] = compare(ref, run(cfg, sdpa, batch, torch.zeros(0)))
    result["memory"] = {"S": S_LONG, **{f"{backend}_{kind}": largest_tensor(backend, kind == "packed")
                                        for backend in ("sdpa", "unfused") for kind in ("causal", "packed")}}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
