"""Trained float32 MTP weights are kept in float32 on export when the source dtype would round them
(bebop_megatron.convert.exporter.trained_mtp_in_fp32); imported ones, exact in the source dtype,
are written in it (the bit-exact round trips of tests/test_convert_export.py rely on that)."""

import torch

from bebop_megatron.convert.exporter import trained_mtp_in_fp32


def _sd(mtp: torch.Tensor) -> dict:
    return {"embedding.word_embeddings.weight": torch.randn(8, 4).bfloat16().float(),
            "mtp.layers.0.eh_proj.weight": mtp, "mtp.layers.0.enorm.weight": torch.ones(4)}


def test_trained_weights_keep_fp32():
    g = torch.Generator().manual_seed(0)
    imported = torch.randn(4, 8, generator=g).bfloat16().float()  # exact in bf16
    trained = imported + 1e-3 * torch.randn(4, 8, generator=g)  # one Adam step away: not exact
    assert not trained_mtp_in_fp32(_sd(imported), torch.bfloat16)
    assert trained_mtp_in_fp32(_sd(trained), torch.bfloat16)
    assert not trained_mtp_in_fp32(_sd(trained), torch.float32)  # nothing to keep: written as is
    # the backbone's tensors do not count
    sd = _sd(imported)
    sd["embedding.word_embeddings.weight"] = torch.randn(8, 4, generator=g)
    assert not trained_mtp_in_fp32(sd, torch.bfloat16)
    # nor does the MoE router's expert bias, written in float32 whatever the source dtype (as published)
    sd["mtp.layers.0.mtp_model_layer.mlp.router.expert_bias"] = torch.randn(4, generator=g)
    assert not trained_mtp_in_fp32(sd, torch.bfloat16)
