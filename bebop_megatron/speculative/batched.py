"""Batched generation over a Megatron-Core GPT model (TP=1, PP=1) with static, preallocated
KV caches: the project's own sampler (``--backend megatron`` of ``tools/generate_responses.py``).

Legend: B batch rows, P prompt slots (the longest prompt), L cache slots, H hidden, V real
vocabulary, nh query heads, ng KV heads, d head dim, T new tokens.

Layout (left padding, one write cursor). Row b's prompt of length n_b is written to cache
slots ``P - n_b .. P - 1`` (``pad_b = P - n_b`` slots of padding before it), so every row's
newest token sits in the same slot and one decode step writes slot ``s`` of every row; row
b's token in slot s has the RoPE position ``s - pad_b`` (its own positions start at 0, as in
transformers' left-padded ``generate``). Attention of row b at slot s sees slots
``pad_b .. s`` (the per-row validity mask); a padding query sees only itself (its output is
finite and never read). Each layer's cache is ``k, v [B, L, ng, d]`` with L fixed before the
prefill (rounded up to a multiple of :data:`SLOT_BUCKET`, so that batches of similar
length share a shape), and SDPA runs over all L slots with the mask: every decode step has
the same shapes, which is what a CUDA graph needs.

Stopping: a row that samples an EOS (or reaches ``max_new_tokens``) is finished; the batch
keeps its shape and the finished rows keep computing (their tokens are dropped) until every
row is finished (checked every :data:`STOP_CHECK_EVERY` steps, one host sync) or
``max_new_tokens`` is reached. No finished row is refilled with a new prompt (no continuous
batching).

Sampling: :func:`bebop_megatron.data.generate_hf.sample_tokens` on float32 logits of the real
vocabulary, row b's t-th token with the t-th uniform of ``torch.Generator().manual_seed(seed_b)``
(float64), as ``HFBackend`` draws them: equal logits give equal tokens.

CUDA graphs (``cuda_graphs=True``, CUDA only): the decode step (embedding, layers, final norm,
logits) is captured for the batch's (B, L) and replayed (re-captured when the shape changes: one
graph and its caches at a time); the sampler runs outside the graph. This
path has never run: it was written without a GPU (see docs/data.md).

Supported: Megatron's standard self-attention layers (MHA / GQA, q/k norms, qkv bias, RoPE as
the model's ``rotary_pos_emb`` computes it) with dense or MoE MLPs (Megatron's own MoE layer,
without token dropping; no CUDA graphs for MoE). Refused with one error line: TP or PP > 1,
multi-latent attention, Gated DeltaNet / output-gated attention, sliding windows, MoE token
dropping or MoE with CUDA graphs, learned absolute positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bebop_megatron.data.generate_hf import sample_tokens
from bebop_megatron.speculative.megatron_model import attention_output, check_attention, layer_forward, qkv_with_rope

SLOT_BUCKET = 64
STOP_CHECK_EVERY = 8
WHAT = "the batched generator (--backend megatron)"


def check_supported(model, cuda_graphs: bool = False) -> None:
    """One-line ``ValueError`` for a model :class:`BatchedGenerator` cannot run."""
    cfg = model.config
    check_attention(cfg, WHAT)
    if getattr(cfg, "num_moe_experts", None):
        if getattr(cfg, "moe_expert_capacity_factor", None) is not None:  # a row's tokens would depend on the batch
            raise ValueError(f"{WHAT} does not support MoE token dropping (moe_expert_capacity_factor "
                             f"{cfg.moe_expert_capacity_factor}): a row's output would depend on the other rows")
        if cuda_graphs:
            raise ValueError(f"{WHAT}: no CUDA graphs for MoE models (Megatron's token dispatch reads the tokens "
                             "per expert on the host); run without --cuda-graphs")
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError(f"{WHAT} needs the whole model in one process (PP=1)")
    kind = getattr(model, "position_embedding_type", "rope")
    if kind not in ("rope", "none"):
        raise ValueError(f"{WHAT} supports RoPE models (and models without positions) only; this one uses {kind}")


@dataclass
class BatchOutput:
    """``tokens[b]``: row b's sampled ids, its first EOS included (cut there) or
    ``max_new_tokens`` of them; ``logits``: ``[B, T, V]`` float32 per step (``keep_logits``)."""

    tokens: list[list[int]]
    finished_by_eos: list[bool]
    logits: torch.Tensor | None = None


class BatchedGenerator:
    """Batched prefill and one-token decode steps of ``model`` (eval mode) over static caches."""

    def __init__(self, model, vocab_size: int, *, eos_ids, cuda_graphs: bool = False):
        check_supported(model, cuda_graphs)
        self.model, self.cfg, self.vocab_size = model, model.config, vocab_size
        self.eos_ids = sorted(set(int(e) for e in eos_ids))
        if not self.eos_ids:
            raise ValueError("the batched generator needs at least one EOS id")
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.cuda_graphs = cuda_graphs
        self.layers = list(model.decoder.layers)
        attn = self.layers[0].self_attention
        self.nh = attn.num_attention_heads_per_partition
        self.ng = attn.num_query_groups_per_partition
        self.d = attn.hidden_size_per_attention_head
        self.scale = self.cfg.softmax_scale or 1.0 / math.sqrt(self.cfg.kv_channels)
        from bebop_megatron.model.builder import output_weight_of

        self.weight_VH = output_weight_of(model)[:vocab_size].detach()
        self.use_rope = getattr(model, "position_embedding_type", "rope") == "rope"
        self._rope_table = None
        self._eos = torch.tensor(self.eos_ids, device=self.device)
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}

    # ------------------------------------------------------------------ pieces

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor | None:
        """RoPE angles ``[*positions.shape, 1, d_rot]`` from the model's own ``rotary_pos_emb``."""
        if not self.use_rope:
            return None
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope_table is None or self._rope_table.shape[0] < need:
            n = max(need, 2 * (0 if self._rope_table is None else self._rope_table.shape[0]), 1024)
            self._rope_table = self.model.rotary_pos_emb(n)[:, 0].to(self.device)  # [n, 1, d_rot]
        return self._rope_table[positions]

    def _ensure_rope(self, n: int) -> None:
        """A RoPE table of at least ``n`` positions. Growing it drops the captured graphs, which
        read the old table."""
        if self.use_rope and (self._rope_table is None or self._rope_table.shape[0] < n):
            self._freqs(torch.tensor([n - 1], device=self.device))
            self._graphs.clear()

    def _sdpa(self, q_SBnd, keys_BLgd, values_BLgd, allowed_BSL):
        """Attention ``[S, B, nh * d]`` of the queries over the given keys. GQA: in a decode step
        (S = 1) without copying the cache, the g = nh / ng query heads of one KV head
        (consecutive in Megatron's order) as g query rows of that head; in the prefill the
        prompt's keys and values are repeated per query head instead (a g-fold mask of S x L
        would cost more than the g-fold keys)."""
        S, B = q_SBnd.shape[:2]
        g = self.nh // self.ng
        kh = keys_BLgd.transpose(1, 2)  # [B, ng, L, d] (a view of the cache)
        vh = values_BLgd.transpose(1, 2)
        if S == 1:
            qh = q_SBnd.permute(1, 2, 0, 3).reshape(B, self.ng, g, self.d)  # [B, ng, g, d]
            mask = allowed_BSL[:, None]  # [B, 1, 1, L]: the same row for the g queries
        else:
            qh = q_SBnd.permute(1, 2, 0, 3)  # [B, nh, S, d]
            kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
            mask = allowed_BSL[:, None]  # [B, 1, S, L]
        ctx = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return ctx.reshape(B, self.nh, S, self.d).permute(2, 0, 1, 3).reshape(S, B, self.nh * self.d)

    def logits(self, hidden_BH: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary (Megatron's padded rows dropped), float32."""
        return (hidden_BH @ self.weight_VH.t()).float()

    def new_caches(self, B: int, L: int):
        shape = (B, L, self.ng, self.d)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]

    # ------------------------------------------------------------------ forward passes

    def prefill(self, ids_BP: torch.Tensor, pad_B: torch.Tensor, caches) -> torch.Tensor:
        """Left-padded prompts ``[B, P]`` into cache slots 0..P-1; last-slot logits ``[B, V]``."""
        B, P = ids_BP.shape
        slots = torch.arange(P, device=self.device)
        positions_BP = (slots[None] - pad_B[:, None]).clamp_(min=0)
        valid_BP = slots[None] >= pad_B[:, None]
        allowed_BPP = (valid_BP[:, None, :] & (slots[None, :, None] >= slots[None, None, :])) \
            | torch.eye(P, dtype=torch.bool, device=self.device)[None]
        freqs = self._freqs(positions_BP.t())  # [P, B, 1, d_rot]
        x = self.model.embedding(input_ids=ids_BP, position_ids=positions_BP)  # [P, B, H]
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            def attention(h, layer=layer, k_cache=k_cache, v_cache=v_cache):
                q, k, v = qkv_with_rope(layer.self_attention, h, freqs, self.cfg)
                k_cache[:, :P] = k.transpose(0, 1)
                v_cache[:, :P] = v.transpose(0, 1)
                ctx = self._sdpa(q, k.transpose(0, 1), v.transpose(0, 1), allowed_BPP)
                return attention_output(layer.self_attention, ctx)

            x = layer_forward(layer, x, attention)
        return self.logits(self.model.decoder.final_layernorm(x[-1:])[0])

    def decode_step(self, tokens_B: torch.Tensor, slot: torch.Tensor, pad_B: torch.Tensor, caches) -> torch.Tensor:
        """One token per row written at cache slot ``slot`` (a 0-d long tensor on the device, so
        that a captured graph reads it); logits ``[B, V]`` of the next token."""
        L = caches[0][0].shape[1]
        positions_B = slot - pad_B
        slots = torch.arange(L, device=self.device)
        allowed_B1L = ((slots[None] >= pad_B[:, None]) & (slots[None] <= slot))[:, None, :]
        freqs = None if not self.use_rope else self._rope_table[positions_B][None]  # [1, B, 1, d_rot]
        x = self.model.embedding(input_ids=tokens_B[:, None], position_ids=positions_B[:, None])  # [1, B, H]
        index = slot.reshape(1)
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            def attention(h, layer=layer, k_cache=k_cache, v_cache=v_cache):
                q, k, v = qkv_with_rope(layer.self_attention, h, freqs, self.cfg)
                k_cache.index_copy_(1, index, k.transpose(0, 1))
                v_cache.index_copy_(1, index, v.transpose(0, 1))
                return attention_output(layer.self_attention, self._sdpa(q, k_cache, v_cache, allowed_B1L))

            x = layer_forward(layer, x, attention)
        return self.logits(self.model.decoder.final_layernorm(x)[0])

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, keep_logits: bool = False) -> BatchOutput:
        """Sample up to ``max_new_tokens`` for every prompt (one batch)."""
        if len(prompts) != len(seeds) or not prompts:
            raise ValueError("one seed per prompt, at least one prompt")
        if any(not p for p in prompts):
            raise ValueError("an empty prompt cannot be generated from")
        B, P, T = len(prompts), max(len(p) for p in prompts), max_new_tokens
        L = -(-(P + T - 1) // SLOT_BUCKET) * SLOT_BUCKET
        ids_BP = torch.zeros((B, P), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids_BP[b, P - len(p):] = torch.tensor(p)
        pad_B = torch.tensor([P - len(p) for p in prompts], device=self.device)
        # Row b's uniforms as HFBackend's _RowSampler draws them (one float64 per step, in order).
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        uniforms_BT = torch.stack([torch.rand(T, generator=g, dtype=torch.float64) for g in gens]).to(self.device)
        self._ensure_rope(L)

        graph = None
        if self.cuda_graphs:
            graph = self._graphs.get((B, L))
            if graph is None:  # one graph (and its caches) at a time: each holds B x L cache slots per layer
                self._graphs.clear()
                graph = self._graphs[(B, L)] = _DecodeGraph(self, B, L)
            caches = graph.caches
        else:
            caches = self.new_caches(B, L)

        out_BT = torch.zeros((B, T), dtype=torch.long, device=self.device)
        done_B = torch.zeros(B, dtype=torch.bool, device=self.device)
        kept = []
        logits_BV = self.prefill(ids_BP.to(self.device), pad_B, caches)
        slot = torch.tensor(P - 1, device=self.device)
        steps = T
        for t in range(T):
            if keep_logits:
                kept.append(logits_BV.clone())  # a captured graph overwrites its output
            token_B = sample_tokens(logits_BV, uniforms_BT[:, t], temperature, top_p)
            out_BT[:, t] = token_B
            done_B |= torch.isin(token_B, self._eos)
            if t == T - 1:
                break
            if (t + 1) % STOP_CHECK_EVERY == 0 and bool(done_B.all()):
                steps = t + 1
                break
            slot += 1
            if graph is not None:
                logits_BV = graph.replay(token_B, slot, pad_B)
            else:
                logits_BV = self.decode_step(token_B, slot, pad_B, caches)

        rows = out_BT[:, :steps].tolist()
        tokens, by_eos = [], []
        eos = set(self.eos_ids)
        for row in rows:
            stop = next((i for i, tok in enumerate(row) if tok in eos), None)
            tokens.append(row if stop is None else row[: stop + 1])
            by_eos.append(stop is not None)
        logits = torch.stack(kept, dim=1) if keep_logits else None
        return BatchOutput(tokens, by_eos, logits)


class _DecodeGraph:
    """The decode step of one (B, L) captured in a CUDA graph with static inputs, caches and
    logits. NEVER RUN on a GPU: written without one (docs/data.md says so); its bookkeeping is
    tested on the CPU with a stand-in graph that re-runs :meth:`step` on replay."""

    def __init__(self, gen: BatchedGenerator, B: int, L: int):
        self.gen = gen
        self.caches = gen.new_caches(B, L)
        self.tokens_B = torch.zeros(B, dtype=torch.long, device=gen.device)
        self.slot = torch.zeros((), dtype=torch.long, device=gen.device)
        self.pad_B = torch.zeros(B, dtype=torch.long, device=gen.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (allocator, lazy inits)
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits_BV = self.step()

    def step(self) -> torch.Tensor:
        """The decode step on the static inputs and caches (what the graph holds)."""
        return self.gen.decode_step(self.tokens_B, self.slot, self.pad_B, self.caches)

    def replay(self, tokens_B, slot, pad_B) -> torch.Tensor:
        self.tokens_B.copy_(tokens_B)
        self.slot.copy_(slot)
        self.pad_B.copy_(pad_B)
        self.graph.replay()
        return self.logits_BV
