"""Key maps of the Qwen3-Next / Qwen3.5 layer pieces (HF <-> Megatron, TP=1).

Gated DeltaNet (``linear_attn.*`` -> ``self_attention.*``): Megatron's ``in_proj`` rows are
``[q (nk*dk) | k (nk*dk) | v (nv*dv) | z (nv*dv) | beta (nv) | alpha (nv)]``. Qwen3.5 stores
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``: concatenated in that order.
Qwen3-Next groups per key head: ``in_proj_qkvz`` is ``[nk, dk | dk | r*dv | r*dv]`` (r = nv/nk)
and ``in_proj_ba`` is ``[nk, r | r]``: each piece is taken from every group. ``b`` is beta
(sigmoid), ``a`` alpha (softplus with ``dt_bias``). ``conv1d``, ``A_log``, ``dt_bias`` and
``out_proj`` are unchanged. The gated norm ``linear_attn.norm`` is a plain ``x * w`` while
Megatron's ``out_norm`` follows the zero-centred ``x * (1 + w)`` of every other Qwen norm:
``w - 1`` is stored (exact in float32 for bf16/fp32 weights).

Gated attention: HF ``q_proj`` rows are per head ``[q_h | gate_h]``; each query group of
Megatron's ``linear_qkv`` is ``[q heads | gate heads | k | v]``.

Shared expert (Qwen3-Next / Qwen3.5-MoE): ``mlp.shared_expert.{gate,up,down}_proj`` and
``mlp.shared_expert_gate.weight`` [1, H] -> ``mlp.shared_experts.linear_fc1/fc2`` and
``mlp.shared_experts.gate_weight``.
"""

from __future__ import annotations

import torch

GDN_PLAIN = ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight")


def _gdn_sizes(shape) -> tuple[int, int, int, int, int]:
    nk, dk, nv, dv = shape.linear_num_key_heads, shape.linear_key_head_dim, shape.linear_num_value_heads, \
        shape.linear_value_head_dim
    return nk, dk, nv, dv, nv // nk


def gdn_to_megatron(get, hf: str, meg: str, shape) -> dict:
    """``hf`` e.g. ``model.layers.0.linear_attn.``, ``meg`` e.g. ``decoder.layers.0.self_attention.``."""
    nk, dk, nv, dv, r = _gdn_sizes(shape)
    if shape.gdn_grouped:  # Qwen3-Next
        qkvz = get(f"{hf}in_proj_qkvz.weight")
        H = qkvz.shape[-1]
        q, k, v, z = torch.split(qkvz.reshape(nk, 2 * dk + 2 * r * dv, H), [dk, dk, r * dv, r * dv], dim=1)
        b, a = torch.split(get(f"{hf}in_proj_ba.weight").reshape(nk, 2 * r, H), [r, r], dim=1)
        pieces = [t.reshape(-1, H) for t in (q, k, v, z, b, a)]
    else:  # Qwen3.5
        pieces = [get(f"{hf}in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
    out = {f"{meg}in_proj.weight": torch.cat(pieces)}
    out.update({f"{meg}{n}": get(f"{hf}{n}") for n in GDN_PLAIN})
    out[f"{meg}out_norm.weight"] = _minus_one(get(f"{hf}norm.weight"))
    return out


def gdn_to_hf(sd: dict, meg: str, hf: str, shape) -> dict:
    """Inverse of :func:`gdn_to_megatron`."""
    nk, dk, nv, dv, r = _gdn_sizes(shape)
    w = sd[f"{meg}in_proj.weight"]
    H = w.shape[-1]
    q, k, v, z, b, a = torch.split(w, [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv])
    if shape.gdn_grouped:
        group = lambda t, n: t.reshape(nk, n, H)  # noqa: E731
        out = {f"{hf}in_proj_qkvz.weight": torch.cat([group(q, dk), group(k, dk), group(v, r * dv),
                                                      group(z, r * dv)], dim=1).reshape(-1, H),
               f"{hf}in_proj_ba.weight": torch.cat([group(b, r), group(a, r)], dim=1).reshape(-1, H)}
    else:
        out = {f"{hf}in_proj_qkv.weight": torch.cat([q, k, v]), f"{hf}in_proj_z.weight": z,
               f"{hf}in_proj_b.weight": b, f"{hf}in_proj_a.weight": a}
    out.update({f"{hf}{n}": sd[f"{meg}{n}"] for n in GDN_PLAIN})
    out[f"{hf}norm.weight"] = _plus_one(sd[f"{meg}out_norm.weight"])
    return out


def _minus_one(w: torch.Tensor) -> torch.Tensor:
    return w.float() - 1.0  # float32: exact for bf16 and fp32 weights, so the round trip is bit-exact


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    return w + 1.0


def split_gated_q(q_proj: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF gated ``q_proj`` (per head ``[q_h | gate_h]``) -> (queries, gates), heads contiguous."""
    tail = q_proj.shape[1:]
    both = q_proj.reshape(num_heads, 2, head_dim, *tail)
    return both[:, 0].reshape(-1, *tail), both[:, 1].reshape(-1, *tail)


def join_gated_q(q: torch.Tensor, gate: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_gated_q`."""
    tail = q.shape[1:]
    return torch.stack([q.reshape(num_heads, head_dim, *tail), gate.reshape(num_heads, head_dim, *tail)],
                       dim=1).reshape(-1, *tail)


def fuse_gated_qkv(q, gate, k, v, shape) -> torch.Tensor:
    """Megatron's gated ``linear_qkv``: per group ``[q heads | gate heads | k | v]``."""
    groups, d = shape.num_kv_heads, shape.head_dim
    per = shape.num_heads // groups
    tail = q.shape[1:]
    parts = (q.reshape(groups, per * d, *tail), gate.reshape(groups, per * d, *tail),
             k.reshape(groups, d, *tail), v.reshape(groups, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_gated_qkv(qkv: torch.Tensor, shape):
    """Inverse of :func:`fuse_gated_qkv`: (q, gate, k, v), heads contiguous."""
    groups, d = shape.num_kv_heads, shape.head_dim
    per = shape.num_heads // groups
    tail = qkv.shape[1:]
    g = qkv.reshape(groups, (2 * per + 2) * d, *tail)
    q, gate, k, v = torch.split(g, [per * d, per * d, d, d], dim=1)
    return tuple(t.reshape(-1, *tail) for t in (q, gate, k, v))


def gated_qkv_to_megatron(get, hf: str, shape) -> torch.Tensor:
    """``hf`` e.g. ``model.layers.1.self_attn.``: q_proj (with gates), k_proj, v_proj -> linear_qkv."""
    q, gate = split_gated_q(get(f"{hf}q_proj.weight"), shape.num_heads, shape.head_dim)
    return fuse_gated_qkv(q, gate, get(f"{hf}k_proj.weight"), get(f"{hf}v_proj.weight"), shape)


def gated_qkv_to_hf(qkv: torch.Tensor, hf: str, shape) -> dict:
    q, gate, k, v = split_gated_qkv(qkv, shape)
    return {f"{hf}q_proj.weight": join_gated_q(q, gate, shape.num_heads, shape.head_dim),
            f"{hf}k_proj.weight": k, f"{hf}v_proj.weight": v}
