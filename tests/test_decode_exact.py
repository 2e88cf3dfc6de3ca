"""The decode-exact forecast (bebop_megatron/chain/decode_exact.py) against a brute-force
simulation of speculative decoding, in float64.

The simulation decodes packed rows of documents (a masked prompt, then a response of fixed
length) with a Markov target p(. | previous token) and MTP-like drafts q_k(. | x_t, input
token of step k): real draft tokens, real accept/reject draws (RS: min(1, p/q) and the
resample from (p - q)+; TO: greedy drafts accepted with p(y) and the resample from p without
y), the bonus token, and a chain capped at the end of its response. It counts the accepted
drafts and verifications. The recursion, run on the text the simulation emitted, must give
the same expectation (paired over the same rows: their difference has mean 0), and run on
plain samples of p it must give the same mean as the simulation (a different sample of
texts), each within its Monte-Carlo error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bebop_megatron.losses import chain_mask
from bebop_megatron.chain.decode_exact import decode_exact_rows, per_text_sums, ratio_interval, run_starts

V, K = 5, 4


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def tables():
    rng = np.random.default_rng(7)
    P = rng.dirichlet(np.full(V, 0.6), size=V)  # p(. | previous token)
    # q_k(. | x_t, step k's input token): close to p(. | input) but not equal, so acceptance is partial.
    Q = _softmax(np.log(P)[None, None] * 0.7 + rng.normal(0, 1.0, size=(K, V, V, V)))
    return P, Q


def _row_layout(rng):
    """Two documents per row: (prompt length, response length) each; the labels of the
    responses are trained, the cross-document label and the prompts are not."""
    docs = [(int(rng.integers(1, 3)), int(rng.integers(2, 9))) for _ in range(2)]
    return docs


def _sample(dist, rng):
    return int(rng.choice(V, p=dist / dist.sum()))


def _simulate_row(P, Q, gamma, mode, docs, rng):
    """Decode one row; returns (tokens, loss_mask, segment_ids, accepted, verifications)."""
    tokens, mask, seg = [], [], []
    acc_total = ver_total = 0
    for d, (n_prompt, n_resp) in enumerate(docs):
        base = len(tokens)
        x = [int(rng.integers(V)) for _ in range(n_prompt)]
        e = n_prompt + n_resp - 1  # index (in x) of the response's last token
        x.append(_sample(P[x[-1]], rng))  # the prefill's token
        while len(x) - 1 < e:
            c = len(x) - 1
            g = min(gamma, e - c)
            drafts, qs = [], []
            for k in range(1, g + 1):
                last = x[c] if k == 1 else drafts[-1]
                q = Q[k - 1, x[c - 1], last]
                drafts.append(_sample(q, rng) if mode == "rs" else int(np.argmax(q)))
                qs.append(q)
            ver_total += 1
            n_acc = 0
            for k in range(g):
                p = P[x[-1]]
                y, q = drafts[k], qs[k]
                ok = rng.random() < (min(1.0, p[y] / q[y]) if mode == "rs" else p[y])
                if ok:
                    x.append(y)
                    n_acc += 1
                    continue
                rest = np.maximum(p - q, 0.0) if mode == "rs" else np.where(np.arange(V) == y, 0.0, p)
                x.append(_sample(rest, rng))
                break
            acc_total += n_acc
            if n_acc == g == gamma and len(x) - 1 < e:
                x.append(_sample(P[x[-1]], rng))  # the bonus token
        assert len(x) == n_prompt + n_resp
        tokens += x
        seg += [d] * len(x)
        m = [0.0] * len(x)
        for t in range(n_prompt - 1, e):  # labels x[n_prompt..e]
            m[t] = 1.0
        mask += m
        del base
    return tokens, mask, seg, acc_total, ver_total


def _plain_row(P, docs, rng):
    tokens, mask, seg = [], [], []
    for d, (n_prompt, n_resp) in enumerate(docs):
        x = [int(rng.integers(V)) for _ in range(n_prompt)]
        for _ in range(n_resp):
            x.append(_sample(P[x[-1]], rng))
        tokens += x
        seg += [d] * len(x)
        mask += [1.0 if n_prompt - 1 <= t < len(x) - 1 else 0.0 for t in range(len(x))]
    return tokens, mask, seg


def _recursion(P, Q, gamma, mode, rows):
    """Expected (accepted, verifications) per row by the recursion, all rows in one call
    (padded with untrained positions of document -1)."""
    from bebop_megatron.chain.masks import chain_valid

    S = max(len(r[0]) for r in rows) + K + 1
    x = np.zeros((len(rows), S), dtype=np.int64)
    lm = torch.zeros(len(rows), S)
    sg = torch.full((len(rows), S), -1)
    for b, (tokens, mask, seg) in enumerate(rows):
        x[b, : len(tokens)] = tokens
        lm[b, : len(mask)] = torch.tensor(mask)
        sg[b, : len(seg)] = torch.tensor(seg)
    chain = chain_valid(lm, K, sg)  # [K, B, S]
    a = np.zeros((K, len(rows), S))
    t = np.arange(S - K - 1)
    for k in range(1, K + 1):
        p = P[x[:, t + k]]  # [B, T, V]
        q = Q[k - 1, x[:, t], x[:, t + k]]
        y = x[:, t + k + 1][..., None]
        py, qy = np.take_along_axis(p, y, -1)[..., 0], np.take_along_axis(q, y, -1)[..., 0]
        a[k - 1, :, t] = (np.minimum(py, qy) / py if mode == "rs" else (y[..., 0] == q.argmax(-1))).T
    accepted, verifications = decode_exact_rows(a, chain, run_starts(lm, sg), gamma)
    return accepted.sum(1), verifications.sum(1)


@pytest.mark.parametrize("mode", ["rs", "to"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_recursion_equals_simulated_decoding(tables, gamma, mode):
    P, Q = tables
    rng = np.random.default_rng(100 * gamma + (mode == "to"))
    decoded, plain, counts = [], [], []
    for _ in range(600):
        docs = _row_layout(rng)
        tokens, mask, seg, acc, ver = _simulate_row(P, Q, gamma, mode, docs, rng)
        decoded.append((tokens, mask, seg))
        counts.append((acc, ver))
        plain.append(_plain_row(P, docs, rng))
    counts = np.asarray(counts, dtype=np.float64)
    on_decoded = np.stack(_recursion(P, Q, gamma, mode, decoded), 1)
    on_plain = np.stack(_recursion(P, Q, gamma, mode, plain), 1)
    for i, name in enumerate(("accepted", "verifications")):
        d = counts[:, i] - on_decoded[:, i]  # paired: the same texts
        se = d.std(ddof=1) / np.sqrt(len(d))
        assert abs(d.mean()) < 4 * se + 1e-12, (name, d.mean(), se)
        sim, rec = counts[:, i], on_plain[:, i]  # independent texts sampled from p
        se = np.sqrt(sim.var(ddof=1) / len(sim) + rec.var(ddof=1) / len(rec))
        assert abs(sim.mean() - rec.mean()) < 4 * se, (name, sim.mean(), rec.mean(), se)
    assert 0 < on_plain[:, 0].sum() < gamma * on_plain[:, 1].sum()  # partial acceptance: a real test


def test_recursion_by_hand():
    """One response of 4 labels (t = 0..3), gamma 2, per-step acceptances written out."""
    a = np.array([[0.5, 0.2, 0.9, 0.7], [0.4, 0.3, 0.6, 0.8]])[:, None]  # [G, 1, S]
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    from bebop_megatron.chain.masks import chain_valid

    chain = chain_valid(mask, 2)[:, 0]  # [2, 5]
    full = np.zeros((2, 1, 5))
    full[:, :, :4] = a
    acc, ver = decode_exact_rows(full, chain[:, None], run_starts(mask), 2)
    # chain at 0: step 1 (0.5) then step 2 (0.4). Rejected at step 1 (0.5) -> chain at 1;
    # accepted then rejected (0.5 * 0.6) -> chain at 2; both accepted (0.2) -> bonus -> chain at 3.
    s = np.zeros(6)
    s[0] = 1.0
    exp_acc = np.zeros(5)
    for t in range(5):
        if not chain[0, t]:
            continue
        m = s[t]
        a1 = full[0, 0, t]
        exp_acc[t] += m * a1
        s[t + 1] += m * (1 - a1)
        if chain[1, t]:
            a2 = full[1, 0, t]
            exp_acc[t] += m * a1 * a2
            s[t + 2] += m * a1 * (1 - a2)
            s[t + 3] += m * a1 * a2
    np.testing.assert_allclose(acc[0], exp_acc, rtol=0, atol=1e-15)
    np.testing.assert_allclose(ver[0], np.where(chain[0].numpy(), s[:5], 0.0), rtol=0, atol=1e-15)
    # One verification at t=0 for sure; the chain at 3 has no room (label 4 untrained).
    assert ver[0, 0] == 1.0 and ver[0, 3] == 0.0


def test_per_text_and_interval():
    seg = np.array([[0, 0, 1, 1, -1], [0, 0, 0, 0, 0]])
    vals = np.array([[1.0, 2.0, 3.0, 4.0, 9.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(per_text_sums(vals, seg), [3.0, 7.0, 5.0])
    ratio, (lo, hi) = ratio_interval([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0], num_boot=500)
    assert ratio == pytest.approx(10.0 / 8.0)
    assert lo < ratio < hi
    assert ratio_interval([1.0], [0.0]) == (None, [None, None])


def test_label_acceptance_matches_float64(tables):
    """acceptance_rows(labels=...) gives min(1, q(x)/p(x)) and 1[x = argmax q] at the labels."""
    from bebop_megatron.metrics import acceptance_rows

    g = torch.Generator().manual_seed(0)
    draft = torch.randn(3, 40, 11, generator=g, dtype=torch.float64)
    target = torch.randn(3, 40, 11, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, 9, (3, 40), generator=g)
    rows = acceptance_rows(draft, target, labels=labels, target_temperature=0.7, draft_temperature=0.7, vocab_size=9,
                           chunk_tokens=16)
    p = torch.softmax(target[..., :9] / 0.7, -1)
    q = torch.softmax(draft[..., :9] / 0.7, -1)
    px, qx = p.gather(-1, labels[..., None])[..., 0], q.gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(rows["accept_rs_label"], torch.minimum(px, qx) / px, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rows["accept_to_label"], (q.argmax(-1) == labels).double())
    # E over x ~ p of the RS acceptance given x is alpha_RS.
    expect = (torch.minimum(p, q)).sum(-1)
    torch.testing.assert_close(rows["alpha_rs"], expect, rtol=1e-12, atol=1e-12)
