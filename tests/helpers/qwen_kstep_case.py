"""K-step draft logits of an imported Qwen3-Next / Qwen3.5 checkpoint against the export's reference.

    python tests/helpers/qwen_kstep_case.py --spec cases.json --out result.json

or as a call of tests/helpers/cli_batch.py (``main(argv)``).

``cases.json``: ``[{"ckpt": Megatron checkpoint, "export": its full HF export}, ...]``. The
Megatron model is built with the checkpoint's one MTP layer reused for K=3 steps (the training
chain, ``post_norm``); ``bebop_megatron.convert.qwen_verify.draft_logits`` recomputes the three
steps from the exported files, handing on the ``mtp.norm`` output as both engines do (and, as a
control, the output before it). Writes ``{"post": [[max|diff| per step] per case], "pre": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

K = 3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch

    from bebop_megatron.config import load_config
    from bebop_megatron.convert import megatron_io, qwen_verify
    from bebop_megatron.convert.hf_io import read_all
    from bebop_megatron.training.model_weights import load_model_weights

    result = {"post": [], "pre": []}
    for case in json.load(open(args.spec)):
        cfg = load_config(os.path.join(case["ckpt"], "bebop_model.yaml"),
                          ["device=cpu", "save.dir=null", "train.resume=none", "model.transformer_impl=local",
                           f"mtp.num_steps={K}"])
        model = megatron_io.build(cfg)
        load_model_weights(case["ckpt"], model, backbone_only=False)
        vocab = cfg.model.vocab_size
        tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
        hidden, logits = megatron_io.forward_hidden_and_logits(model, tokens, vocab)
        sd = megatron_io.weights(model)
        emb = sd["embedding.word_embeddings.weight"][:vocab]
        head = sd.get("output_layer.weight", emb)[:vocab]
        written = read_all(case["export"])
        with open(os.path.join(case["export"], "config.json")) as f:
            config = json.load(f)
        for key, handoff in (("post", "post_norm"), ("pre", "pre_norm")):
            refs = qwen_verify.draft_logits(written, config, hidden[0], tokens, K, emb, head, handoff=handoff)
            result[key].append([(logits[k + 1][:, :ref.shape[1]] - ref).abs().max().item()
                                for k, ref in enumerate(refs)])
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
