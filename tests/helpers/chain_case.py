"""MTP chain: ``mtp.next_step_input`` pre_norm against post_norm on the same weights.

    python tests/helpers/chain_case.py --out result.json

For one layer per step and for one repeated layer: builds both models (one process, TP=1),
gives them identical weights, then compares each step's output hidden state with the MTP
final norms' weights (a) random around 1 and (b) all ones. Writes the max abs difference
per step for both cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bebop_megatron.config import load_config  # noqa: E402  (quiets Megatron's notices first)

TINY = ["device=cpu", "save.dir=null", "train.resume=none", "model.num_layers=2", "model.hidden_size=64",
        "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.vocab_size=200", "mtp.num_steps=3"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from bebop_megatron.model import build_model
    from bebop_megatron.model.builder import PreNormChainMTPLayer
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.parallel import setup_parallel

    init_distributed("cpu")
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    result = {}
    for num_layers in (3, 1):
        models = {}
        for chain in ("post_norm", "pre_norm"):
            cfg = load_config(overrides=[*TINY, f"mtp.num_layers={num_layers}", f"mtp.next_step_input={chain}"])
            setup_parallel(cfg, 1)
            models[chain] = build_model(cfg, "cpu").eval()
        post, pre = models["post_norm"], models["pre_norm"]
        assert isinstance(pre.mtp.layers[0], PreNormChainMTPLayer)
        assert not isinstance(post.mtp.layers[0], PreNormChainMTPLayer)
        pre.load_state_dict(post.state_dict())
        for case in ("random_norms", "unit_norms"):
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for layer_post, layer_pre in zip(post.mtp.layers, pre.mtp.layers):
                    w = torch.ones(64) if case == "unit_norms" else 1 + 0.3 * torch.randn(64, generator=g)
                    layer_post.final_layernorm.weight.copy_(w)
                    layer_pre.final_layernorm.weight.copy_(w)
                h_post = torch.chunk(post(tokens, pos, None), 4, dim=0)
                h_pre = torch.chunk(pre(tokens, pos, None), 4, dim=0)
            result[f"layers{num_layers}/{case}"] = [(a - b).abs().max().item() for a, b in zip(h_post, h_pre)]
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
