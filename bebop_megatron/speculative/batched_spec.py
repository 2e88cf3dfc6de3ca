"""Batched speculative decoding over static KV caches: B prompts at once, ragged acceptance.

Legend: B rows (prompts) still decoding, G gamma, S positions in one call, L cache slots,
H hidden, V vocabulary, ng KV heads, g = nh / ng query heads per KV head, d head dim.

The same algorithm as :func:`bebop_megatron.speculative.decoding.speculative_steps` over
:class:`~bebop_megatron.speculative.megatron_model.MegatronSpecModel` (the same Megatron
modules, the same MTP chain semantics, the same acceptance rules and random draws), for a
batch of rows that accept different numbers of drafts per verification.

Cache layout: slot = position. Every row owns slots 0..L-1 of each static cache (the
backbone's layers and each MTP step's layer: keys and values ``[B, L, ng, d]``) and of the
hidden-state stores (the backbone's final hidden and each step's hand-off hidden, ``[B, L,
H]``). A call over S positions writes row b's slots ``start_b .. start_b + S - 1`` (its own
start) and its queries attend to the slots at or before their own position. Rows are
ragged: row b's newest token is at index ``c_b`` (not yet in the backbone's cache, which
holds positions 0..c_b-1), and MTP step k has committed the positions before ``f_k,b``. A
rejected draft needs no rollback: its slots lie past the row's cursor, are masked from every
query that could read them, and are overwritten by the next call. A call pads the rows to its
longest S; the padded positions lie past the row's cursor too (their results are dropped).
The prompts are right-padded in the prefill (every row at positions 0..P-1; a row's pad
slots lie past its cursor).

MTP step k at position t (Megatron training's chain, DESIGN.md section 1) takes step k-1's
hand-off hidden at t and the embedding of token t+k. In a round, step k runs over the
positions f_k..c-1 (those whose inputs changed since its last commit); it drafts from
position c-1, and commits the positions whose inputs are all accepted tokens (t + k <= c).

Randomness, per row: row b draws from its own ``torch.Generator`` exactly what the
single-sequence decoder draws from its generator (one uniform for the first token; per
round, RS: one uniform per drafted token, then G + 1 for the verification; TO: G + 1), so a
row's output does not depend on the other rows, up to the rounding of batched float
arithmetic (the tests compare the two decoders token for token). ``temperature=0`` is
greedy: drafts and tokens are argmax (lowest index on ties), a draft is accepted when it is
the target's argmax; nothing is drawn.

Rows that finish (``max_new_tokens`` new tokens or a stop token) leave the batch at the end
of the round (its tensors are compacted); no new prompt takes their place.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from bebop_megatron.chain.sampling import inverse_cdf
from bebop_megatron.speculative.decoding import MODES, Generation, Round, truncate_at_stop, probs_of
from bebop_megatron.speculative.megatron_model import attention_output, check_attention, layer_forward, qkv_with_rope

WHAT = "the batched speculative decoder"


def accept_rs(p_BGV, q_BGV, drafts_BG, u_BG, u_B):
    """Rejection sampling of B chains (:func:`~bebop_megatron.chain.sampling.chain_rejection_sample`
    per row) with the given uniforms: ``(num_accepted [B], next_token [B])``."""
    B, G, _ = q_BGV.shape
    y = drafts_BG[..., None]
    accept = u_BG * q_BGV.gather(-1, y)[..., 0] < p_BGV[:, :G].gather(-1, y)[..., 0]
    num = accept.long().cumprod(-1).sum(-1)
    rows = torch.arange(B)
    p_row = p_BGV[rows, num]
    q_row = torch.cat([q_BGV, torch.zeros_like(q_BGV[:, :1])], 1)[rows, num]  # 0 for the bonus row
    residual = (p_row - q_row).clamp_(min=0.0)
    residual = torch.where((residual.sum(-1) > 0)[:, None], residual, p_row)
    return num, inverse_cdf(residual, u_B)


def accept_to(p_BGV, drafts_BG, u_BG, u_B):
    """Target-only verification of B chains of greedy drafts
    (:func:`~bebop_megatron.chain.sampling.chain_target_only` per row) with the given uniforms."""
    B, G = drafts_BG.shape
    num = (u_BG < p_BGV[:, :G].gather(-1, drafts_BG[..., None])[..., 0]).long().cumprod(-1).sum(-1)
    rows = torch.arange(B)
    weights = p_BGV[rows, num].clone()
    rejected = num < G
    weights[rows[rejected], drafts_BG[rows[rejected], num[rejected]]] = 0.0
    return num, inverse_cdf(weights, u_B)


def accept_greedy(target_logits_BGV, drafts_BG):
    """Greedy verification: drafts accepted while each is the target's argmax; the next token
    is the target's argmax after them."""
    B, G = drafts_BG.shape
    best = target_logits_BGV.argmax(-1)  # [B, G+1]
    num = (best[:, :G] == drafts_BG).long().cumprod(-1).sum(-1)
    return num, best[torch.arange(B), num]


class _State:
    """The caches and cursors of one batched decoding (row-indexed tensors, compacted together)."""

    def __init__(self, m: "BatchedSpecModel", B: int, L: int, gamma: int):
        shape = (B, L, m.ng, m.d)
        kv = lambda: (torch.zeros(shape, dtype=m.dtype), torch.zeros(shape, dtype=m.dtype))  # noqa: E731
        self.caches = [kv() for _ in m.layers]
        self.mtp_caches = [kv() for _ in range(gamma)]
        self.h0 = torch.zeros((B, L, m.hidden), dtype=m.dtype)
        self.hand = [torch.zeros((B, L, m.hidden), dtype=m.dtype) for _ in range(gamma)]
        self.f = [torch.zeros(B, dtype=torch.long) for _ in range(gamma)]
        self.tok = torch.zeros((B, L + gamma + 2), dtype=torch.long)
        self.c = torch.zeros(B, dtype=torch.long)
        self.rows = list(range(B))  # the original row of each live row

    def select(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long)
        self.caches = [(k[idx], v[idx]) for k, v in self.caches]
        self.mtp_caches = [(k[idx], v[idx]) for k, v in self.mtp_caches]
        self.h0, self.hand = self.h0[idx], [h[idx] for h in self.hand]
        self.f = [f[idx] for f in self.f]
        self.tok, self.c = self.tok[idx], self.c[idx]
        self.rows = [self.rows[i] for i in keep]


class BatchedSpecModel:
    """Batched prefill, MTP drafting and verification of ``model`` (eval mode, TP=1, PP=1) over
    static caches; :meth:`generate_steps` decodes a batch of prompts speculatively (or plainly
    with ``gamma=0``)."""

    def __init__(self, model, vocab_size: int, weight_VH: torch.Tensor | None = None):
        from bebop_megatron.model.builder import output_weight_of

        cfg = model.config
        check_attention(cfg, WHAT)
        if not getattr(model, "mtp_process", False):
            raise ValueError("the model has no MTP block on this rank (PP must be 1)")
        if getattr(cfg, "num_moe_experts", None) and getattr(cfg, "moe_expert_capacity_factor", None) is not None:
            raise ValueError(f"{WHAT} does not support MoE token dropping: a row's output would depend on the others")
        from bebop_megatron.model.builder import PreNormChainMTPLayer

        self.model, self.cfg, self.vocab_size = model, cfg, vocab_size
        self.layers = list(model.decoder.layers)
        self.num_steps = cfg.mtp_num_layers
        self.repeated = bool(model.mtp.mtp_use_repeated_layer)
        self.pre_norm = isinstance(model.mtp.layers[0], PreNormChainMTPLayer)
        attn = self.layers[0].self_attention
        self.nh = attn.num_attention_heads_per_partition
        self.ng = attn.num_query_groups_per_partition
        self.d = attn.hidden_size_per_attention_head
        self.hidden = cfg.hidden_size
        self.dtype = next(model.parameters()).dtype
        self.scale = cfg.softmax_scale or 1.0 / math.sqrt(cfg.kv_channels)
        self.weight_VH = output_weight_of(model)[:vocab_size].detach().float() if weight_VH is None else weight_VH
        self.use_rope = getattr(model, "position_embedding_type", "rope") == "rope"
        self._rope = None

    def max_gamma(self) -> int:
        return 10**6 if self.repeated else self.num_steps

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary (Megatron's padded columns dropped), float32."""
        return hidden.float() @ self.weight_VH.t()

    # ------------------------------------------------------------------ layers

    def _freqs(self, positions_SB: torch.Tensor):
        """RoPE of the positions: the angles ``[S, B, 1, d_rot]`` (Megatron's fused-RoPE config),
        else their ``(cos, sin)`` in the model's dtype, computed once for every layer of a call
        (Megatron's unfused RoPE recomputes them for q and k of every layer: a fifth of a decode
        step of SmolLM2-135M)."""
        if not self.use_rope:
            return None
        need = int(positions_SB.max()) + 1
        if self._rope is None or self._rope.shape[0] < need:
            n = max(need, 2 * (0 if self._rope is None else self._rope.shape[0]), 256)
            self._rope = self.model.rotary_pos_emb(n)[:, 0]  # [n, 1, d_rot]
        freqs = self._rope[positions_SB]  # [S, B, 1, d_rot]
        if getattr(self.cfg, "apply_rope_fusion", False):
            return freqs
        return torch.cos(freqs).to(self.dtype), torch.sin(freqs).to(self.dtype)

    def _qkv(self, attn, x_SBH, rope):
        """:func:`qkv_with_rope` with the cos and sin given: the same arithmetic as Megatron's
        unfused ``_apply_rotary_pos_emb_bshd`` (mscale 1, no MLA interleaving)."""
        if not isinstance(rope, tuple):
            return qkv_with_rope(attn, x_SBH, rope, self.cfg)
        from megatron.core.models.common.embeddings.rope_utils import _rotate_half

        cos, sin = rope
        q, k, v = attn.get_query_key_value_tensors(x_SBH, None)[:3]
        rot, interleaved = cos.shape[-1], self.cfg.rotary_interleaved

        def apply(t):
            t, t_pass = t[..., :rot], t[..., rot:]
            return torch.cat(((t * cos) + (_rotate_half(t, interleaved) * sin), t_pass), dim=-1)

        return apply(q), apply(k), v

    def _attention(self, attn, x_SBH, freqs, slots_BS, cache):
        """Writes the keys and values of row b's S positions into its slots ``slots_BS[b]`` and
        attends each query to the row's slots at or before its own."""
        k_cache, v_cache = cache
        q, k, v = self._qkv(attn, x_SBH, freqs)  # [S, B, nh|ng, d]
        S, B = q.shape[:2]
        rows = torch.arange(B)[:, None]
        k_cache[rows, slots_BS] = k.transpose(0, 1).to(k_cache.dtype)
        v_cache[rows, slots_BS] = v.transpose(0, 1).to(v_cache.dtype)
        L = int(slots_BS.max()) + 1
        g = self.nh // self.ng
        kh = k_cache[:, :L].transpose(1, 2)  # [B, ng, L, d]
        vh = v_cache[:, :L].transpose(1, 2)
        # the g query heads of one KV head (consecutive in Megatron's order) as g x S query rows
        qh = q.permute(1, 2, 0, 3).reshape(B, self.ng, g * S, self.d)
        allowed = torch.arange(L)[None, None, :] <= slots_BS[:, :, None]  # [B, S, L]
        mask = allowed.repeat(1, g, 1)[:, None]  # [B, 1, g*S, L]
        ctx = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return attention_output(attn, ctx.reshape(B, self.nh, S, self.d).permute(2, 0, 1, 3).reshape(S, B, -1))

    def _stack(self, layer, x_SBH, freqs, slots_BS, cache):
        return layer_forward(layer, x_SBH, lambda h: self._attention(layer.self_attention, h, freqs, slots_BS, cache))

    def backbone(self, st: _State, tokens_BS: torch.Tensor, start_B: torch.Tensor) -> torch.Tensor:
        """Final hidden ``[B, S, H]`` (after the final norm) of row b's tokens at positions
        ``start_b ..``, written into the caches and into the hidden store."""
        S = tokens_BS.shape[1]
        pos_BS = start_B[:, None] + torch.arange(S)
        freqs = self._freqs(pos_BS.t())
        x = self.model.embedding(input_ids=tokens_BS, position_ids=pos_BS)  # [S, B, H]
        for layer, cache in zip(self.layers, st.caches):
            x = self._stack(layer, x, freqs, pos_BS, cache)
        hidden = self.model.decoder.final_layernorm(x).transpose(0, 1)
        st.h0[torch.arange(len(start_B))[:, None], pos_BS] = hidden
        return hidden

    def mtp_step(self, st: _State, k: int, tokens_BS, prev_BSH, pos_BS):
        """MTP step k at positions ``pos_BS`` (token t+k, step k-1's hidden at t): the hand-off
        hidden is written into step k's store; returns the normed output ``[B, S, H]``."""
        layer = self.model.mtp.layers[0 if self.repeated else k - 1]
        freqs = self._freqs(pos_BS.t())
        emb = self.model.embedding(input_ids=tokens_BS, position_ids=pos_BS)  # [S, B, H]
        x = layer._concat_embeddings(prev_BSH.transpose(0, 1), emb)
        y = self._stack(layer.mtp_model_layer, x, freqs, pos_BS, st.mtp_caches[k - 1])
        normed = layer.final_layernorm(y)
        hand = y if self.pre_norm else normed
        st.hand[k - 1][torch.arange(pos_BS.shape[0])[:, None], pos_BS] = hand.transpose(0, 1)
        return normed.transpose(0, 1)

    # ------------------------------------------------------------------ decoding

    @torch.no_grad()
    def generate_steps(self, prompts: list[list[int]], seeds: list[int], outs: list[Generation], *, gamma: int,
                       temperature: float, max_new_tokens: int, mode: str = "rs", stop_ids=()):
        """Decode ``prompts`` as one batch into ``outs`` (one :class:`Generation` per prompt, given
        empty: ``Generation(len(p), list(p))``); a generator yielding after the prefill and after
        every round. ``gamma=0``: plain decoding (one token per target forward, as
        :func:`~bebop_megatron.speculative.decoding.autoregressive_steps`). Wall times of a
        call are split evenly over the rows it ran (their sum is the batch's wall time)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if gamma < 0 or gamma > self.max_gamma():
            raise ValueError(f"gamma must be 0..{self.max_gamma()} (the model's MTP layers), got {gamma}")
        if not prompts or len(seeds) != len(prompts) or len(outs) != len(prompts) or any(not p for p in prompts):
            raise ValueError("one seed and one output per prompt, at least one prompt, no empty prompt")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        greedy = temperature == 0
        stop = torch.tensor(sorted(set(int(s) for s in stop_ids)), dtype=torch.long)
        B, G = len(prompts), gamma
        lens = torch.tensor([len(p) for p in prompts])
        P = int(lens.max())
        L = P + max_new_tokens + 3 * G + 2
        st = _State(self, B, L, G)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        for b, p in enumerate(prompts):
            st.tok[b, : len(p)] = torch.tensor(p)

        def share(field, seconds, rows):
            for r in rows:
                setattr(outs[r], field, getattr(outs[r], field) + seconds / len(rows))

        t0 = time.perf_counter()
        hidden = self.backbone(st, st.tok[:, :P], torch.zeros(B, dtype=torch.long))
        first = self.logits(hidden[torch.arange(B), lens - 1])  # [B, V]
        st.c = lens.clone()
        u_first = None if greedy else [torch.rand(1, generator=g, dtype=torch.float64) for g in gens]
        st.tok[torch.arange(B), st.c] = self._sample(first, temperature, u_first)
        share("prefill_seconds", time.perf_counter() - t0, range(B))
        yield
        self._finished(st, lens, max_new_tokens, stop, outs, torch.full((B,), -1))
        ar = torch.arange(G + 1)
        while st.rows:
            n = len(st.rows)
            rows_n = torch.arange(n)
            c = st.c
            t0 = time.perf_counter()
            drafts, draft_logits = [], []
            u_rows = None
            if not greedy:
                count = (2 * G + 1) if (mode == "rs" and G) else (G + 1)
                u_rows = torch.stack([torch.rand(count, generator=gens[r], dtype=torch.float64) for r in st.rows])
            for k in range(1, G + 1):
                f = st.f[k - 1]
                S_B = c - f
                pos = f[:, None] + torch.arange(int(S_B.max()))
                pos = pos.clamp(max=L - 1)
                prev = st.h0 if k == 1 else st.hand[k - 2]
                normed = self.mtp_step(st, k, st.tok[rows_n[:, None], pos + k], prev[rows_n[:, None], pos], pos)
                logits = self.logits(normed[rows_n, S_B - 1])  # drafted at position c-1
                if greedy or mode == "to":
                    token = logits.argmax(-1)
                else:
                    token = inverse_cdf(probs_of(logits, temperature), u_rows[:, k - 1])
                drafts.append(token)
                draft_logits.append(logits)
                st.tok[rows_n, c + k] = token
                st.f[k - 1] = torch.maximum(f, c - k + 1)
            t1 = time.perf_counter()
            target_logits = self.logits(self.backbone(st, st.tok[rows_n[:, None], c[:, None] + ar], c))  # [n, G+1, V]
            t2 = time.perf_counter()
            if G == 0:
                num = torch.zeros(n, dtype=torch.long)
                nxt = self._sample(target_logits[:, 0], temperature, None if greedy else u_rows[:, 0])
                alphas = [[] for _ in range(n)]
            else:
                d_BG, q_logits = torch.stack(drafts, 1), torch.stack(draft_logits, 1)
                if greedy:
                    num, nxt = accept_greedy(target_logits, d_BG)
                    alphas = (target_logits[:, :G].argmax(-1) == d_BG).double().tolist()
                else:
                    p, q = probs_of(target_logits, temperature), probs_of(q_logits, temperature)
                    u_chain = u_rows[:, -(G + 1):]
                    if mode == "rs":
                        num, nxt = accept_rs(p, q, d_BG, u_chain[:, :G], u_chain[:, G])
                        alphas = torch.minimum(p[:, :G], q).sum(-1).tolist()
                    else:
                        num, nxt = accept_to(p, d_BG, u_chain[:, :G], u_chain[:, G])
                        alphas = p[:, :G].gather(-1, d_BG[..., None])[..., 0].tolist()
            st.tok[rows_n, c + num + 1] = nxt
            old_c = c
            st.c = c + num + 1
            t3 = time.perf_counter()
            share("draft_seconds", t1 - t0, st.rows)
            share("target_seconds", t2 - t1 + t3 - t2, st.rows)
            for i, r in enumerate(st.rows):
                outs[r].target_forwards += 1
                if G:
                    a = int(num[i])
                    outs[r].rounds.append(Round(int(old_c[i]), a, alphas[i][: a + 1]))
            yield
            self._finished(st, lens, max_new_tokens, stop, outs, old_c)

    def _sample(self, logits_BV, temperature, uniforms):
        if temperature == 0:
            return logits_BV.argmax(-1)
        u = torch.cat(uniforms) if isinstance(uniforms, list) else uniforms
        return inverse_cdf(probs_of(logits_BV, temperature), u)

    @staticmethod
    def _finished(st: _State, lens, max_new_tokens, stop, outs, old_c) -> None:
        """Rows done after the last round (``max_new_tokens`` new tokens or a stop token among the
        new ones) written into ``outs`` and dropped from the batch."""
        keep, stop_set = [], set(stop.tolist())
        tok = st.tok.tolist()
        for i, r in enumerate(st.rows):
            c, P = int(st.c[i]), int(lens[r])
            new = tok[i][max(P, int(old_c[i]) + 1): c + 1]
            if c + 1 - P >= max_new_tokens or any(t in stop_set for t in new):
                outs[r].tokens = tok[i][: c + 1]
                outs[r].accepted = list(outs[r].tokens)
                truncate_at_stop(outs[r], max_new_tokens, stop_set)
            else:
                keep.append(i)
        if len(keep) < len(st.rows):
            st.select(keep)


def batched_generate(model: BatchedSpecModel, prompts, seeds, **kw) -> list[Generation]:
    """:meth:`BatchedSpecModel.generate_steps` run to the end; one :class:`Generation` per prompt."""
    outs = [Generation(len(p), list(p)) for p in prompts]
    for _ in model.generate_steps(prompts, seeds, outs, **kw):
        pass
    return outs
