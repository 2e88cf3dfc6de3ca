"""The batched speculative decoder (``bebop_megatron/speculative/batched_spec.py``) on a tiny
Megatron MTP model built in this process, against independent references:

- greedy (temperature 0): every row's tokens equal plain greedy decoding of the backbone by its
  full no-cache forward (one forward of the whole text per token), with prompts of different
  lengths (one filling most of the cache), rows stopping at different points (a stop token or
  max_new_tokens) and rows accepting different numbers of drafts per verification;
- sampled (RS, TO, plain): each row's tokens, accepted counts and online alphas equal the
  single-sequence decoder's (:class:`MegatronSpecModel` with
  :func:`speculative_generate`, whose output distribution is tested to be the target's in
  ``tests/test_speculative_generate.py``) with the same seed, at B = 1 and in a batch; so the
  batched RS output distribution is the target's too;
- ``run_config_batched`` (the tool's path) gives the same texts and statistics as
  ``run_config`` (the single-sequence path).

The tiny model's MTP layers are made to draft the backbone's next token often (the backbone is
nearly a bigram model of the embedding; each MTP layer passes the token's embedding through), so
that greedy drafts are accepted some of the time, not never.
"""

from __future__ import annotations

import pytest
import torch

from bebop_megatron.speculative.decoding import autoregressive_generate, speculative_generate

V = 64
TINY = ["device=cpu", "save.dir=null", "train.resume=none", "model.num_layers=2", "model.hidden_size=64",
        "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
        f"model.vocab_size={V}", "mtp.num_steps=3", "mtp.num_layers=3"]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors, one intra-op thread


@pytest.fixture(scope="module")
def tiny():
    """A random MTP model (GQA, 2 layers, 3 MTP layers) whose backbone layers are damped (so the
    next token mostly follows the current one) and whose MTP layers pass the drafted token's
    embedding through (so step k drafts roughly the backbone's bigram successor)."""
    from bebop_megatron.config import load_config
    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.parallel import setup_parallel
    from tests.helpers.single_process import single_process

    with single_process():
        init_distributed("cpu")
        cfg = load_config(overrides=TINY)
        setup_parallel(cfg, 1)
        torch.manual_seed(0)
        model = build_model(cfg, "cpu").eval()
        H = cfg.model.hidden_size
        with torch.no_grad():
            for layer in model.decoder.layers:
                layer.self_attention.linear_proj.weight.mul_(3.0)
                layer.mlp.linear_fc2.weight.mul_(0.5)
            for i, layer in enumerate(model.mtp.layers):
                w = torch.zeros(H, 2 * H)
                w[:, :H] = torch.eye(H)
                w[:, H:] = 0.3 * (i + 1) * torch.randn(H, H) / H ** 0.5
                layer.eh_proj.weight.copy_(w)
                layer.final_layernorm.weight.copy_(model.decoder.final_layernorm.weight)
            model.embedding.word_embeddings.weight.mul_(30.0)  # sharper logits
        yield model


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """Backbone logits ``[S, V]`` of the model's own full forward (no cache)."""
    from bebop_megatron.model.builder import output_weight_of

    with torch.no_grad():
        hidden = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)
    backbone = torch.chunk(hidden, 1 + model.config.mtp_num_layers, 0)[0][:, 0]
    return backbone.float() @ output_weight_of(model)[:V].detach().float().t()


def greedy_reference(model, prompt, max_new_tokens, stop_ids):
    out = list(prompt)
    while len(out) - len(prompt) < max_new_tokens:
        out.append(int(full_logits(model, out)[-1].argmax()))
        if out[-1] in stop_ids:
            break
    return out


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_equals_plain_greedy_decoding(tiny, gamma):
    from bebop_megatron.speculative.batched_spec import BatchedSpecModel, batched_generate

    max_new = 14
    prompts = prompts_of([3, 40, 9, 1, 17])  # the 40-token prompt fills most of the 40+14+... slots
    free = [greedy_reference(tiny, p, max_new, ()) for p in prompts]
    stop = {free[0][len(prompts[0]) + 4]}  # row 0 stops at its 5th new token (or earlier)
    refs = [greedy_reference(tiny, p, max_new, stop) for p in prompts]
    outs = batched_generate(BatchedSpecModel(tiny, V), prompts, [0] * len(prompts), gamma=gamma, temperature=0.0,
                            max_new_tokens=max_new, stop_ids=stop)
    for out, ref in zip(outs, refs):
        assert out.tokens == ref
    lengths = [len(o.new_tokens) for o in outs]
    assert min(lengths) <= 5 and max_new in lengths  # rows finished at different times
    accepted = [r.num_accepted for o in outs for r in o.rounds]
    assert len(set(accepted)) >= 2 and max(accepted) >= 1  # ragged verifications, some drafts accepted
    # every round emitted its accepted drafts and one more token
    for o in outs:
        assert sum(r.num_accepted + 1 for r in o.rounds) + 1 >= len(o.new_tokens)


@pytest.mark.parametrize("mode,temperature,gamma", [("rs", 1.0, 3), ("rs", 0.7, 2), ("to", 1.0, 2), ("rs", 1.0, 0)])
def test_batched_equals_single_sequence_decoder(tiny, mode, temperature, gamma):
    """Same seeds, same tokens and acceptance: at B = 1 and with five rows of different lengths.
    (Both decoders compute in fp32 with different reduction shapes; the logits agree to
    rounding, so equality could in principle fail on a uniform within ~1e-6 of a CDF boundary:
    it does not for these seeds.)"""
    from bebop_megatron.speculative.batched_spec import BatchedSpecModel, batched_generate
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel

    prompts, seeds, max_new, stop = prompts_of([4, 11, 2, 25, 7], seed=1), [5, 17, 2, 9, 40], 16, {3}
    single = MegatronSpecModel(tiny, V)
    refs = []
    for p, s in zip(prompts, seeds):
        g = torch.Generator().manual_seed(s)
        if gamma == 0:
            refs.append(autoregressive_generate(single, p, temperature=temperature, max_new_tokens=max_new,
                                                generator=g, stop_ids=stop))
        else:
            refs.append(speculative_generate(single, p, gamma=gamma, temperature=temperature, max_new_tokens=max_new,
                                             mode=mode, generator=g, stop_ids=stop))
    batched = BatchedSpecModel(tiny, V)
    kw = dict(gamma=gamma, temperature=temperature, max_new_tokens=max_new, mode=mode, stop_ids=stop)
    together = batched_generate(batched, prompts, seeds, **kw)
    alone = [batched_generate(batched, [p], [s], **kw)[0] for p, s in zip(prompts, seeds)]
    for outs in (together, alone):
        for out, ref in zip(outs, refs):
            assert out.tokens == ref.tokens and out.accepted == ref.accepted
            assert out.target_forwards == ref.target_forwards
            assert [(r.start, r.num_accepted) for r in out.rounds] == [(r.start, r.num_accepted) for r in ref.rounds]
            for a, b in zip(out.rounds, ref.rounds):
                assert a.online_alpha == pytest.approx(b.online_alpha, abs=1e-5)
    if gamma:
        counts = [r.num_accepted for o in together for r in o.rounds]
        assert len(set(counts)) >= 2
    assert len({len(o.new_tokens) for o in together}) >= 2  # a stop token ended some rows early


def test_run_config_batched_equals_run_config(tiny):
    """The tool's batched path: the same texts, acceptance counts and forecasts as the
    single-sequence path, with batches that do not divide the prompts."""
    from bebop_megatron.speculative.batched_spec import BatchedSpecModel
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel
    from bebop_megatron.speculative.session import run_config, run_config_batched

    prompts = prompts_of([5, 9, 3, 14, 6], seed=2)
    kw = dict(gamma=2, temperature=1.0, mode="rs", max_new_tokens=10, seed=3, stop_ids={7}, baseline=True)
    spec = MegatronSpecModel(tiny, V)
    ref = run_config(spec, prompts, **kw, baseline_model=MegatronSpecModel(tiny, V, weight_VH=spec.weight_VH))
    got = run_config_batched(BatchedSpecModel(tiny, V), spec, prompts, batch_size=2, **kw)
    assert got["texts"] == ref["texts"]
    for key in ("num_verifications", "measured_accept_len", "new_tokens", "target_forwards",
                "tokens_per_target_forward"):
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key
    # the teacher-forced forecasts: recomputed from scratch here, from the single decoder's
    # cached state there (equal to rounding, tests/helpers/speculative_case.py)
    assert got["expected_verifications"] == pytest.approx(ref["expected_verifications"], rel=1e-6)
    assert [(p["attempts"], p["accepted"]) for p in got["per_position"]] == \
        [(p["attempts"], p["accepted"]) for p in ref["per_position"]]
    assert got["predicted_accept_len_decode"] == pytest.approx(ref["predicted_accept_len_decode"], abs=1e-6)
    assert got["baseline"]["new_tokens"] == ref["baseline"]["new_tokens"]
    assert got["tokens_per_second"] > 0 and got["baseline"]["tokens_per_second"] > 0


def test_refusals(tiny):
    from bebop_megatron.speculative.batched_spec import BatchedSpecModel, batched_generate

    m = BatchedSpecModel(tiny, V)
    with pytest.raises(ValueError, match="gamma must be 0..3"):
        batched_generate(m, [[1, 2]], [0], gamma=4, temperature=1.0, max_new_tokens=3)
    with pytest.raises(ValueError, match="no empty prompt"):
        batched_generate(m, [[1], []], [0, 1], gamma=1, temperature=1.0, max_new_tokens=3)


def test_repeated_layer_and_pre_norm_hand_off(tiny):
    """One MTP layer reused for three draft steps (as an import of a model without MTP layers
    serves it) with the pre-norm hand-off: the batched decoder still gives the single-sequence
    decoder's tokens and acceptance counts. (Built in ``tiny``'s process group; last in the file.)"""
    from bebop_megatron.config import load_config
    from bebop_megatron.model import build_model
    from bebop_megatron.model.builder import PreNormChainMTPLayer
    from bebop_megatron.speculative.batched_spec import BatchedSpecModel, batched_generate
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel
    from bebop_megatron.training.parallel import setup_parallel

    cfg = load_config(overrides=[*TINY[:-1], "mtp.num_layers=1", "mtp.next_step_input=pre_norm"])
    setup_parallel(cfg, 1)
    torch.manual_seed(1)
    model = build_model(cfg, "cpu").eval()
    assert isinstance(model.mtp.layers[0], PreNormChainMTPLayer) and model.mtp.mtp_use_repeated_layer
    with torch.no_grad():  # a final norm away from 1, so that pre- and post-norm hand-offs differ
        weight = model.mtp.layers[0].final_layernorm.weight
        weight.copy_(1 + 0.5 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    prompts, seeds = prompts_of([6, 13, 3], seed=3), [1, 2, 3]
    kw = dict(gamma=3, temperature=1.0, max_new_tokens=15, mode="rs")
    single = MegatronSpecModel(model, V)
    refs = [speculative_generate(single, p, generator=torch.Generator().manual_seed(s), **kw)
            for p, s in zip(prompts, seeds)]
    outs = batched_generate(BatchedSpecModel(model, V), prompts, seeds, **kw)
    for out, ref in zip(outs, refs):
        assert out.tokens == ref.tokens
        assert [r.num_accepted for r in out.rounds] == [r.num_accepted for r in ref.rounds]
    assert len({r.num_accepted for o in outs for r in o.rounds}) >= 2
