"""Model FLOPs of one training step and model FLOPs utilisation (MFU).

A step runs the frozen backbone forward once and the MTP chain forward and backward, so its
FLOPs are (per token; a matmul [m, k] x [k, n] counts 2mkn):

    backbone forward = L * layer + 2 H V                      (decoder layers, output layer)
    MTP, per step k  = 3 * (4 H^2 + layer) + 4 H V            (eh_proj [2H -> H] and one layer,
                                                               forward + backward at 2x forward;
                                                               output layer forward + input grad:
                                                               it is frozen, no weight grad)
    step             = tokens * (backbone forward + K * MTP per step)

    (MoE models: ``model.moe_first_dense_layers`` leading backbone layers are dense; every
    other layer, the MTP layer included, is MoE.)

    layer (dense)    = attention + 6 H F                       (SwiGLU: gate, up, down)
    layer (MoE)      = attention + 2 H E + topk * 6 H F_e + 6 H F_shared
    attention        = 2 H (n_q d + 2 n_kv d) + 2 n_q d H + 4 S n_q d
                       (QKV and output projections; QK^T and AV over the full S x S matrix,
                        the usual convention, although a causal kernel does about half)
    attention (MLA)  = 2 H r_q + 2 r_q n_q (d_qk + d_r) + 2 H (r_kv + d_r) + 2 r_kv n_q (d_qk + d_v)
                       + 2 n_q d_v H + 2 S n_q (d_qk + d_r + d_v)
                       (Multi-Latent Attention, DeepSeek-V3: query latent r_q, or 2 H n_q (d_qk + d_r)
                        without one; key/value latent r_kv, head widths d_qk + d_r rope, d_v value)

with H hidden, F FFN width, V padded vocabulary, S sequence length, d head dimension, n_q/n_kv
query/key-value heads, E experts, K MTP steps. Norms, activations, the router's softmax and
embeddings are left out (each well under 1%).
"""

from __future__ import annotations

from bebop_megatron.config import Config
from bebop_megatron.model.builder import padded_vocab_size

# Dense bf16 peak TFLOP/s per GPU (no sparsity); fp8 doubles it, fp32 (TF32) halves it.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "B200": 2250.0, "GB200": 2500.0}


def layer_flops_per_token(cfg: Config, dense: bool = False) -> float:
    """Forward FLOPs of one decoder (or MTP) transformer layer, per token (``dense``: a
    leading dense layer of an MoE model)."""
    m, S = cfg.model, cfg.train.seq_length
    H = m.hidden_size
    d = m.kv_channels or H // m.num_attention_heads
    nq, nkv = m.num_attention_heads, m.num_query_groups
    attention = 2 * H * (nq * d + 2 * nkv * d) + 2 * nq * d * H + 4 * S * nq * d
    if m.multi_latent_attention:
        dq, dr, dv, rq, rkv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.q_lora_rank, m.kv_lora_rank
        q = 2 * H * rq + 2 * rq * nq * (dq + dr) if rq else 2 * H * nq * (dq + dr)
        attention = (q + 2 * H * (rkv + dr) + 2 * rkv * nq * (dq + dv) + 2 * nq * dv * H
                     + 2 * S * nq * (dq + dr + dv))
    if m.family == "moe" and not dense:
        ffn_e = m.moe_ffn_hidden_size or m.ffn_hidden_size
        mlp = 2 * H * m.num_experts + m.moe_router_topk * 6 * H * ffn_e
        if m.moe_shared_expert_intermediate_size:
            mlp += 6 * H * m.moe_shared_expert_intermediate_size
    else:
        mlp = 6 * H * m.ffn_hidden_size
    return float(attention + mlp)


def step_flops(cfg: Config) -> dict[str, float]:
    """Model FLOPs of one optimizer step over the global batch: backbone, MTP and total."""
    m, K = cfg.model, cfg.mtp.num_steps
    H, V = m.hidden_size, padded_vocab_size(cfg)
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    layer = layer_flops_per_token(cfg)
    num_dense = m.moe_first_dense_layers if m.family == "moe" else 0
    decoder = (m.num_layers - num_dense) * layer + num_dense * layer_flops_per_token(cfg, dense=True)
    backbone = tokens * (decoder + 2 * H * V)
    mtp = tokens * K * (3 * (4 * H * H + layer) + 4 * H * V)
    return {"backbone_forward": backbone, "mtp_forward_backward": mtp, "total": backbone + mtp}


def peak_tflops_per_device(device: str, precision: str, override: float | None) -> float | None:
    """Peak TFLOP/s of one device: ``override`` if given, else looked up from the GPU name."""
    if override is not None:
        return override
    if device != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name()
    for key, bf16 in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return bf16 * {"fp8": 2.0, "bf16": 1.0, "fp32": 0.5}[precision]
    return None


def mfu(flops: float, seconds: float, world_size: int, peak_tflops: float | None) -> float | None:
    """Achieved model FLOP/s over the peak of all devices (None without a known peak)."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops / seconds / (world_size * peak_tflops * 1e12)
