"""The trained Megatron ``MTPGPTModel`` as a :class:`~bebop_megatron.speculative.decoding.SpecModel`,
with KV caches, for one sequence at TP=1, PP=1.

Legend: S positions in one call, H hidden, V vocabulary, G gamma, ng KV heads, d head dim.

Megatron-Core's own static inference cache turns attention masking off for every call after
the prefill (``attention.py``: ``no_mask`` once ``sequence_len_offset > 0``), so it cannot
verify G+1 tokens in one forward. This module therefore runs Megatron's own modules
(``input_layernorm``, ``linear_qkv`` via ``get_query_key_value_tensors``, Megatron's
``apply_rotary_pos_emb``, ``linear_proj``, ``pre_mlp_layernorm``, ``mlp``; the MTP layer's
``enorm``/``hnorm``/``eh_proj`` via ``_concat_embeddings`` and ``final_layernorm``) and only
replaces the core attention by ``scaled_dot_product_attention`` over a per-layer KV cache
with a causal mask offset by the cached length. ``tests/test_speculative_generate.py``
checks that it reproduces the model's full-sequence forward (backbone and every MTP step).

MTP chain semantics (Megatron training's, DESIGN.md section 1): step k at position t takes
step k-1's hidden state at t (the backbone's after its final norm for k=1; after the MTP
final norm for k>1, or before it with ``mtp.next_step_input=pre_norm``) and the embedding
of token t+k, and its transformer layer attends to step k's own inputs at positions <= t.
Each step keeps its own KV cache of the positions whose inputs are final (accepted
tokens); the positions that involve drafted tokens are recomputed in every round and
dropped. (vLLM / SGLang run an EAGLE-style shared cache, Megatron's dynamic engine attends
to the single drafting position only; the hand-off of the hidden state is the same.)

The committed step-k outputs are the teacher-forced ones on the accepted text, which is
what :meth:`teacher_forced_logits` returns for the prediction of Eq. 12.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb


def check_attention(cfg, what: str) -> None:
    """``ValueError`` (one line) unless every layer is Megatron's standard self-attention
    (GQA or MHA, RoPE or none) at TP=1: what :func:`qkv_with_rope` and SDPA over a cache run."""
    if getattr(cfg, "multi_latent_attention", False):
        raise ValueError(f"{what} supports standard (GQA) attention; this model uses multi-latent attention (MLA)")
    if getattr(cfg, "attention_output_gate", False) or getattr(cfg, "experimental_attention_variant", None):
        raise ValueError(f"{what} supports standard (GQA) attention; this model uses an output gate or "
                         "linear-attention layers (Gated DeltaNet)")
    if getattr(cfg, "tensor_model_parallel_size", 1) != 1 or getattr(cfg, "pipeline_model_parallel_size", 1) != 1:
        raise ValueError(f"{what} runs one process at TP=1, PP=1; this model is built at "
                         f"TP={cfg.tensor_model_parallel_size}, PP={cfg.pipeline_model_parallel_size}")
    if getattr(cfg, "window_size", None) is not None:
        raise ValueError(f"{what} does not support sliding-window attention (window_size {cfg.window_size})")


def qkv_with_rope(attn, x_SBH: torch.Tensor, freqs: torch.Tensor | None, cfg):
    """Megatron's own query/key/value projection (with its q/k norms) and RoPE:
    ``q [S, B, nh, d]``, ``k, v [S, B, ng, d]``; ``freqs`` broadcasts against ``[S, B, 1, d]``
    (one position per row and step), ``None`` for a model without RoPE."""
    q, k, v = attn.get_query_key_value_tensors(x_SBH, None)[:3]
    if freqs is not None:
        q = apply_rotary_pos_emb(q, freqs, config=cfg)
        k = apply_rotary_pos_emb(k, freqs, config=cfg)
    return q, k, v


def attention_output(attn, ctx_SBH: torch.Tensor) -> torch.Tensor:
    """The output projection of the attention context ``[S, B, nh * d]`` (its bias added)."""
    out, bias = attn.linear_proj(ctx_SBH)
    return out if bias is None else out + bias


def layer_forward(layer, x_SBH: torch.Tensor, attention) -> torch.Tensor:
    """One Megatron ``TransformerLayer`` (pre-norm, residuals, no dropout in eval) with the core
    attention replaced by ``attention(normed x) -> projected output``."""
    x_SBH = x_SBH + attention(layer.input_layernorm(x_SBH))
    out, bias = layer.mlp(layer.pre_mlp_layernorm(x_SBH))
    return x_SBH + (out if bias is None else out + bias)


class KVCache:
    """Keys and values ``[L, ng, d]`` of one attention layer for one sequence."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def truncate(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:n], self.v[:n]


class MegatronSpecModel:
    """Drafts with the MTP block and verifies with the backbone of ``model`` (eval mode)."""

    def __init__(self, model, vocab_size: int, weight_VH: torch.Tensor | None = None):
        from bebop_megatron.model.builder import PreNormChainMTPLayer
        from bebop_megatron.model.builder import output_weight_of

        cfg = model.config
        if getattr(cfg, "multi_latent_attention", False) or getattr(cfg, "attention_output_gate", False):
            raise ValueError("speculative decoding supports standard (GQA) attention; this model uses "
                             "multi-latent attention or an output gate")
        if not getattr(model, "mtp_process", False):
            raise ValueError("the model has no MTP block on this rank (PP must be 1)")
        self.model, self.cfg, self.vocab_size = model, cfg, vocab_size
        self.num_steps = cfg.mtp_num_layers
        self.repeated = bool(model.mtp.mtp_use_repeated_layer)
        self.pre_norm = isinstance(model.mtp.layers[0], PreNormChainMTPLayer)
        # float32 logits over the real vocabulary (as tools/eval_acceptance.py computes them), one copy
        # (``weight_VH``: share another instance's copy, e.g. for two sequences at once)
        self.weight_VH = output_weight_of(model)[:vocab_size].detach().float() if weight_VH is None else weight_VH
        self.scale = cfg.softmax_scale or 1.0 / math.sqrt(cfg.kv_channels)
        self.rope = None
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        self.caches = [KVCache() for _ in self.model.decoder.layers]
        self.tokens: list[int] = []  # the tokens in the backbone's cache
        self.h0 = None  # [L, H] backbone final hidden of the cached positions
        self.pending = None  # hidden of the last verification, kept by keep()
        self.mtp_caches: dict[int, KVCache] = {}
        self.mtp_store: dict[int, torch.Tensor] = {}  # step k -> [f_k, H] committed hand-off hidden

    def max_gamma(self) -> int:
        return 10**6 if self.repeated else self.num_steps

    def _rope(self, positions: torch.Tensor) -> torch.Tensor:
        need = int(positions.max()) + 1
        if self.rope is None or self.rope.shape[0] < need:
            self.rope = self.model.rotary_pos_emb(max(need, 2 * (0 if self.rope is None else self.rope.shape[0]),
                                                      256))
        return self.rope[positions]

    def logits(self, hidden_SH: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary (Megatron's padded columns dropped), float32."""
        return hidden_SH.float() @ self.weight_VH.t()

    # ------------------------------------------------------------------ layers

    def _attention(self, layer, x_SBH, positions, cache: KVCache, keep: int):
        attn = layer.self_attention
        q, k, v = qkv_with_rope(attn, x_SBH, self._rope(positions), self.cfg)  # [S, 1, nh|ng, d]
        past = len(cache)
        keys = k[:, 0] if cache.k is None else torch.cat([cache.k, k[:, 0]])
        values = v[:, 0] if cache.v is None else torch.cat([cache.v, v[:, 0]])
        cache.k, cache.v = keys[: past + keep], values[: past + keep]
        S, L = q.shape[0], keys.shape[0]
        nh, ng = q.shape[2], keys.shape[1]
        qh = q[:, 0].transpose(0, 1)  # [nh, S, d]
        kh = keys.transpose(0, 1).repeat_interleave(nh // ng, 0)
        vh = values.transpose(0, 1).repeat_interleave(nh // ng, 0)
        allowed = torch.arange(L)[None, :] <= (past + torch.arange(S))[:, None]  # causal, offset by the cache
        ctx = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=self.scale)
        return attention_output(attn, ctx.transpose(0, 1).reshape(S, 1, -1))

    def _layer(self, layer, x_SBH, positions, cache: KVCache, keep: int):
        return layer_forward(layer, x_SBH, lambda h: self._attention(layer, h, positions, cache, keep))

    def _backbone(self, tokens: list[int], start: int) -> torch.Tensor:
        """Final hidden ``[S, H]`` (after the final norm) of ``tokens`` at positions start.."""
        ids = torch.tensor([tokens])
        positions = torch.arange(start, start + len(tokens))
        x = self.model.embedding(input_ids=ids, position_ids=positions[None])
        for layer, cache in zip(self.model.decoder.layers, self.caches):
            x = self._layer(layer, x, positions, cache, keep=len(tokens))
        return self.model.decoder.final_layernorm(x)[:, 0]

    def _mtp_step(self, k: int, hidden_SH, token_ids: list[int], start: int, keep: int):
        """MTP step k over positions start..: (hand-off hidden [S, H], normed output [S, H])."""
        layer = self.model.mtp.layers[0 if self.repeated else k - 1]
        cache = self.mtp_caches.setdefault(k, KVCache())
        positions = torch.arange(start, start + len(token_ids))
        emb = self.model.embedding(input_ids=torch.tensor([token_ids]), position_ids=positions[None])
        x = layer._concat_embeddings(hidden_SH[:, None], emb)
        y = self._layer(layer.mtp_model_layer, x, positions, cache, keep)[:, 0]
        normed = layer.final_layernorm(y)
        return (y if self.pre_norm else normed), normed

    # ------------------------------------------------------------------ SpecModel

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        self.reset()
        self.h0 = self._backbone(prompt_ids, 0)
        self.tokens = list(prompt_ids)
        return self.logits(self.h0[-1])

    @torch.no_grad()
    def verify(self, new_tokens: list[int]) -> torch.Tensor:
        hidden = self._backbone(new_tokens, len(self.caches[0]))
        self.pending, self.pending_tokens = hidden, list(new_tokens)
        return self.logits(hidden)

    def keep(self, n: int) -> None:
        for cache in self.caches:
            cache.truncate(len(cache) - self.pending.shape[0] + n)
        self.h0 = torch.cat([self.h0, self.pending[:n]])
        self.tokens += self.pending_tokens[:n]
        self.pending = None

    @torch.no_grad()
    def draft(self, tokens: list[int], gamma: int, pick):
        """Steps 1..gamma at the last cached position c-1 (c = len(tokens)-1, the newest token)."""
        if gamma > self.max_gamma():
            raise ValueError(f"gamma {gamma} exceeds the model's {self.num_steps} MTP layers (not repeated)")
        c = len(tokens) - 1
        assert self.h0.shape[0] == c, (self.h0.shape, c)
        ext = list(tokens)
        prev_src, drafts, draft_logits = self.h0, [], []  # prev_src[t]: step k-1 hidden at t
        for k in range(1, gamma + 1):
            store = self.mtp_store.get(k)
            f = 0 if store is None else store.shape[0]
            num_commit = max(0, min(c - k + 1, prev_src.shape[0]) - f)  # inputs final: t+k <= c
            hand, normed = self._mtp_step(k, prev_src[f:c], ext[f + k: c + k], f, keep=num_commit)
            self.mtp_store[k] = hand[:num_commit] if store is None else torch.cat([store, hand[:num_commit]])
            prev_src = torch.cat([self.mtp_store[k][:f], hand])
            if pick is None:  # only committing the chain (teacher_forced_logits)
                ext.append(0)
                continue
            logits = self.logits(normed[-1])
            token = pick(logits)
            drafts.append(token)
            draft_logits.append(logits)
            ext.append(token)
        return drafts, (torch.stack(draft_logits) if draft_logits else None)

    # ------------------------------------------------------------------ teacher forcing

    @torch.no_grad()
    def teacher_forced_logits(self, tokens: list[int], gamma: int, first: int, state_tokens=None, partial=False):
        """Teacher-forced draft and target logits ``[G, N, V]`` for positions t = first.. at which
        every step 1..gamma is defined on ``tokens`` (t + gamma <= len - 1); row k-1 holds step k
        at t and its target, the backbone at t+k. ``(None, None)`` when there is no such t.
        ``partial``: every t = first..len-2 instead (the chains cut by the end of ``tokens``);
        step k's rows past t = len-1-k (no backbone position t+k) are zeros.

        ``state_tokens``: every token accepted by the generation that just ran (its cache holds
        all but the newest). Then the cached state is reused: the committed chain positions are
        teacher-forced ones (their inputs are accepted tokens); one more chain pass commits the
        rest and one backbone forward adds the newest token. Otherwise the backbone and the
        chain are recomputed from scratch. Either equals the model's full forward (tested)."""
        L = len(tokens)
        last = L - 2 if partial else L - 1 - gamma
        if last < first:
            return None, None
        if (state_tokens is not None and self.pending is None and len(state_tokens) == len(self.tokens) + 1
                and state_tokens[:-1] == self.tokens and list(tokens) == list(state_tokens[:L])):
            self.draft(state_tokens, gamma, pick=None)  # commits step k up to c-k; no logits
            self.verify([state_tokens[-1]])
            self.keep(1)
            stores = [self.mtp_store[k] for k in range(1, gamma + 1)]
            layers = [self.model.mtp.layers[0 if self.repeated else k - 1] for k in range(1, gamma + 1)]
            normed = [layer.final_layernorm(h) if self.pre_norm else h for layer, h in zip(layers, stores)]
        else:
            self.prefill(tokens)
            src, normed = self.h0, []
            for k in range(1, gamma + 1):
                self.mtp_caches.pop(k, None)
                n = L - k
                if n < 1:  # gamma beyond the text (a repeated layer): step k has no position
                    normed.append(self.h0.new_zeros((0, self.h0.shape[1])))
                    continue
                hand, out = self._mtp_step(k, src[:n], tokens[k:], 0, keep=n)
                normed.append(out)
                src = hand
        N = last + 1 - first
        drafts = self.weight_VH.new_zeros((gamma, N, self.weight_VH.shape[0]))
        targets = torch.zeros_like(drafts)
        for k in range(1, gamma + 1):
            stop = min(last, L - 1 - k) + 1  # the target of step k at t is the backbone at t+k
            if stop > first:
                drafts[k - 1, : stop - first] = self.logits(normed[k - 1][first:stop])
                targets[k - 1, : stop - first] = self.logits(self.h0[first + k: stop + k])
        return drafts, targets
