"""Reference pieces shared by every format's ``--verify`` forward (``verify.py``, ``qwen_verify.py``):
the causal mask of a transformers decoder layer, the K-step draft chain and the fused-expert layout."""

from __future__ import annotations

import torch


def causal_mask(B: int, L: int) -> torch.Tensor:
    mask = torch.full((L, L), torch.finfo(torch.float32).min).triu(1)
    return mask.expand(B, 1, L, L)


def fused_experts(sd: dict, num_experts: int) -> dict:
    """Per-expert HF names -> transformers' in-memory ``experts.gate_up_proj`` / ``down_proj``."""
    gate_up, down = [], []
    for j in range(num_experts):
        gate_up.append(torch.cat([sd.pop(f"mlp.experts.{j}.gate_proj.weight"), sd.pop(f"mlp.experts.{j}.up_proj.weight")]))
        down.append(sd.pop(f"mlp.experts.{j}.down_proj.weight"))
    sd["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    sd["mlp.experts.down_proj"] = torch.stack(down)
    return sd


@torch.no_grad()
def draft_chain(ref, hidden_BSH: torch.Tensor, tokens_BS: torch.Tensor, num_steps: int,
                handoff: str = "post_norm") -> list[torch.Tensor]:
    """K draft steps of any format's reference; step k's logits are ``[B, S-k, V]``. Step k runs
    MTP layer ``(k-1) % ref.num_layers`` and hands step k+1 its output after the final norm
    (``post_norm``) or before it (``pre_norm``)."""
    S = tokens_BS.shape[1]
    h = hidden_BSH.to(torch.promote_types(hidden_BSH.dtype, torch.float32))  # float32 at least
    out = []
    for k in range(1, num_steps + 1):
        L = S - k
        i = (k - 1) % ref.num_layers
        y, normed = ref.step(i, h[:, :L], tokens_BS[:, k:k + L])
        out.append(ref.logits(i, normed))
        h = y if handoff == "pre_norm" else normed
    return out
