"""Real speculative decoding on the real model: measured vs predicted accepted length and the
wall-time speed-up over plain decoding, per gamma and temperature (issue #16).

    PYTHONPATH=. python benchmarks/real_model/speculative.py --run runs/fresh/ce/seed0 \
        --gammas 1 2 3 --temperatures 1 0.7 --num-prompts 4 --max-new-tokens 32 --publish

Runs ``tools/speculative_generate.py``'s logic (:mod:`bebop_megatron.speculative`) on a trained
checkpoint of ``run_objectives.py`` (the objective study's run folder under ``<cache>/runs/cpu``,
whose last checkpoint ``run_objectives.py`` keeps: ``<cache>/runs/cpu/<run>/ckpt``) over the
first ``--num-prompts`` held-out prompts (``runs/cpu/prompts/heldout.jsonl``, chat template of
the backbone's tokenizer). For each prompt and temperature, plain decoding (one target
forward per token) and speculative decoding for every gamma run one after the other in this
process with the same model and KV-cache code, so a change of machine load hits them alike;
the speed-up is (plain seconds per token) / (speculative seconds per token), decode only (the
prefill is the same for both and left out). The weights are cast to float32 (``--precision``):
torch's bfloat16 matmuls are slower on this CPU.

Resumable: every (prompt, temperature, gamma) result is a JSON file under
``<cache>/runs/cpu/<run>/speculative/``; a rerun skips the finished ones. ``--publish`` writes
the table into ``benchmarks/real_model/RESULTS.md`` (between the speculative markers) and
appends rows to ``benchmarks/results.csv``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from pipeline import cache_root, log  # noqa: E402

BEGIN, END = "<!-- speculative: begin (benchmarks/real_model/speculative.py) -->", "<!-- speculative: end -->"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/fresh/ce/seed0",
                   help="a run folder of run_objectives.py's study under <cache>/runs/cpu (default runs/fresh/ce/seed0)")
    p.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--publish", action="store_true", help="write RESULTS.md's table and CSV rows")
    p.add_argument("--summarize-only", action="store_true", help="only build the table from finished files")
    p.add_argument("--lockstep", action="store_true",
                   help="speed-up only: plain and speculative decoding of the same prompt advanced in turn, one "
                        "forward / verification each (two caches), so that load changes hit both alike")
    return p.parse_args(argv)


def gen_record(gen, rows=None) -> dict:
    """A generation as JSON; ``rows``: its teacher-forced values (``teacher_forced_rows``: Eq. 12's
    alphas and the decode-exact expected accepted drafts and verifications)."""
    rec = {"prompt_len": gen.prompt_len, "tokens": gen.tokens, "accepted": gen.accepted,
           "target_forwards": gen.target_forwards, "target_seconds": gen.target_seconds,
           "prefill_seconds": gen.prefill_seconds, "draft_seconds": gen.draft_seconds,
           "rounds": [[r.start, r.num_accepted, r.online_alpha] for r in gen.rounds]}
    if rows is not None:
        rec["alpha"], rec["positions"] = rows["alpha"].tolist(), rows["positions"]
        rec["tf_accepted"], rec["tf_verifications"] = rows["accepted"], rows["verifications"]
    return rec


def finished(path: Path, speculative: bool) -> bool:
    """A finished generation's file; a speculative one written before the decode-exact forecast
    (no ``tf_accepted``) is run again."""
    if not path.exists():
        return False
    return not speculative or "tf_accepted" in json.loads(path.read_text())


def gen_of(rec: dict):
    from bebop_megatron.speculative.decoding import Generation, Round

    g = Generation(prompt_len=rec["prompt_len"], tokens=rec["tokens"], accepted=rec["accepted"],
                   target_forwards=rec["target_forwards"], target_seconds=rec["target_seconds"],
                   prefill_seconds=rec["prefill_seconds"], draft_seconds=rec["draft_seconds"])
    g.rounds = [Round(*r) for r in rec["rounds"]]
    return g


def name(kind: str, tau: float, gamma: int | None, i: int) -> str:
    return f"T{tau:g}_{kind}{'' if gamma is None else gamma}_p{i}.json"


def generate(args, out: Path) -> None:
    from bebop_megatron.data.generate import read_prompts
    from bebop_megatron.data.tokenizer import tokenizer_from_dir
    from bebop_megatron.speculative.decoding import (
        Generation,
        autoregressive_generate,
        autoregressive_steps,
        lockstep,
        speculative_generate,
        speculative_steps,
    )
    from bebop_megatron.speculative.measure import teacher_forced_rows
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel
    from bebop_megatron.speculative.session import load, prompt_ids, stop_ids_of

    if args.lockstep:
        todo = [(i, tau, g) for i in range(args.num_prompts) for tau in args.temperatures for g in args.gammas
                if not (out / name("ls", tau, g, i)).exists()]
    else:
        todo = [(i, tau, g) for i in range(args.num_prompts) for tau in args.temperatures
                for g in [None, *args.gammas] if not finished(out / name("ar" if g is None else "g", tau, g, i), g is not None)]
    if not todo:
        log("every configuration is done")
        return
    root = cache_root() / "runs" / "cpu"
    t0 = time.perf_counter()
    model, cfg = load(str(root / args.run / "ckpt"), "cpu", precision=args.precision)
    spec = MegatronSpecModel(model, cfg.model.vocab_size)
    second = MegatronSpecModel(model, cfg.model.vocab_size, weight_VH=spec.weight_VH)  # plain decoding's cache
    tokenizer = tokenizer_from_dir(cfg.data.tokenizer)
    prompts = read_prompts(str(root / "prompts" / "heldout.jsonl"), args.num_prompts).prompts
    stop = stop_ids_of(tokenizer)
    log(f"loaded {args.run} in {time.perf_counter() - t0:.0f}s; {len(todo)} generations to run")
    start = time.perf_counter()
    for n, (i, tau, g) in enumerate(todo, 1):
        ids = prompt_ids(tokenizer, prompts[i].messages)
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
        if args.lockstep:
            plain, res = Generation(len(ids), list(ids)), Generation(len(ids), list(ids))
            lockstep(autoregressive_steps(second, plain, temperature=tau, max_new_tokens=args.max_new_tokens,
                                          generator=torch.Generator().manual_seed(args.seed * 1_000_003 + i),
                                          stop_ids=stop),
                     speculative_steps(spec, res, gamma=g, temperature=tau, max_new_tokens=args.max_new_tokens,
                                       mode="rs", generator=gen, stop_ids=stop))
            rec = {"plain": gen_record(plain), "spec": gen_record(res)}
        elif g is None:
            res = autoregressive_generate(spec, ids, temperature=tau, max_new_tokens=args.max_new_tokens,
                                          generator=gen, stop_ids=stop)
            rec = gen_record(res)
        else:
            res = speculative_generate(spec, ids, gamma=g, temperature=tau, max_new_tokens=args.max_new_tokens,
                                       mode="rs", generator=gen, stop_ids=stop)
            rec = gen_record(res, teacher_forced_rows(spec, res, g, tau, "rs", max_new_tokens=args.max_new_tokens,
                                                      stop_ids=stop))
        path = out / name("ls" if args.lockstep else "ar" if g is None else "g", tau, g, i)
        path.with_suffix(".tmp").write_text(json.dumps(rec))
        path.with_suffix(".tmp").rename(path)
        spent = time.perf_counter() - start
        log(f"[{n}/{len(todo)}] prompt {i} T={tau:g} {'plain' if g is None else f'gamma={g}'}: "
            f"{len(res.new_tokens)} tokens, {res.target_forwards} target forwards, "
            f"{res.target_seconds + res.draft_seconds:.1f}s decode | ETA {spent / n * (len(todo) - n) / 60:.1f} min")


def summarize(args, out: Path) -> list[dict]:
    from bebop_megatron.speculative.session import summarize as summarize_config

    rows = []
    for tau in args.temperatures:
        for g in args.gammas:
            done = [i for i in range(args.num_prompts)
                    if finished(out / name("g", tau, g, i), True) and (out / name("ar", tau, None, i)).exists()]
            if not done:
                continue
            recs = [json.loads((out / name("g", tau, g, i)).read_text()) for i in done]
            plain = [gen_of(json.loads((out / name("ar", tau, None, i)).read_text())) for i in done]
            gens = [gen_of(r) for r in recs]
            alphas = [{"alpha": torch.tensor(r["alpha"], dtype=torch.float64).reshape(g, -1), "positions": r["positions"],
                       "accepted": r["tf_accepted"], "verifications": r["tf_verifications"]} for r in recs]
            res = summarize_config(gens, alphas, plain, gamma=g, temperature=tau, mode="rs",
                                   max_new_tokens=args.max_new_tokens, seed=args.seed)
            res["prompts"] = len(done)
            ls = [json.loads((out / name("ls", tau, g, i)).read_text()) for i in range(args.num_prompts)
                  if (out / name("ls", tau, g, i)).exists()]
            if ls:
                pl, sp = [gen_of(r["plain"]) for r in ls], [gen_of(r["spec"]) for r in ls]
                per_tok = lambda xs, f: sum(f(x) for x in xs) / max(sum(len(x.new_tokens) for x in xs), 1)  # noqa: E731
                res["lockstep_speedup"] = (per_tok(pl, lambda x: x.target_seconds)
                                           / per_tok(sp, lambda x: x.target_seconds + x.draft_seconds))
                res["lockstep_prompts"] = len(ls)
            res["speedup_per_prompt"] = [
                (a.target_seconds / max(len(a.new_tokens), 1))
                / ((x.target_seconds + x.draft_seconds) / max(len(x.new_tokens), 1)) for a, x in zip(plain, gens)]
            rows.append(res)
    return rows


def verify_cost(r: dict) -> float:
    """Seconds per verification (gamma+1 tokens) over seconds per plain forward (1 token)."""
    plain = r["baseline"]["seconds"] / max(r["baseline"]["target_forwards"], 1)
    return r["wall_seconds"]["target"] / max(r["target_forwards"], 1) / plain


def _ci(v, ci) -> str:
    return f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def table(rows: list[dict], args) -> str:
    lines = ["| T | gamma | verifications | measured accepted / verification | predicted E[L] (Eq. 12, "
             "teacher-forced) | predicted at the verification starts | accept rate per draft position "
             "(accepted/attempts) | tokens / target forward | verification cost (plain forwards) | draft share of "
             "decode time | speed-up vs plain "
             "(range over prompts) | speed-up, lockstep (prompts) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = ", ".join(f"{p['rate']:.3f} ({p['accepted']}/{p['attempts']})" for p in r["per_position"])
        wall = r["wall_seconds"]
        share = wall["draft"] / max(wall["draft"] + wall["target"], 1e-9)
        lockstep = f"{r['lockstep_speedup']:.2f}x ({r['lockstep_prompts']})" if "lockstep_speedup" in r else "n/a"
        per_prompt = f"({min(r['speedup_per_prompt']):.2f}-{max(r['speedup_per_prompt']):.2f})"
        lines.append(f"| {r['temperature']:g} | {r['gamma']} | {r['num_verifications']} | "
                     f"{_ci(r['measured_accept_len'], r['ci95'])} | "
                     f"{_ci(r['predicted_accept_len'], r['predicted_ci95'])} | "
                     f"{_ci(r['predicted_accept_len_at_starts'], r['predicted_at_starts_ci95'])} | {pos} | "
                     f"{r['tokens_per_target_forward']:.3f} | {verify_cost(r):.2f} | {share:.2f} | {r['speedup']:.2f}x {per_prompt} | "
                     f"{lockstep} |")
    return "\n".join(lines)


def publish(rows: list[dict], args, text: str) -> None:
    import torch as _torch

    from common import append_results, replace_marked_section

    path = HERE / "RESULTS.md"
    path.write_text(replace_marked_section(path.read_text() if path.exists() else "", text, BEGIN, END))
    for r in rows:
        params = {"model": "qwen2.5-coder-1.5b", "run": args.run, "gamma": r["gamma"], "T": r["temperature"],
                  "mode": "rs", "prompts": r["prompts"], "max_new_tokens": args.max_new_tokens,
                  "precision": args.precision}
        metrics = {"measured_accept_len": r["measured_accept_len"], "measured_ci_lo": r["ci95"][0],
                   "measured_ci_hi": r["ci95"][1], "predicted_accept_len": r["predicted_accept_len"],
                   "predicted_accept_len_at_starts": r["predicted_accept_len_at_starts"],
                   "tokens_per_target_forward": r["tokens_per_target_forward"], "speedup": r["speedup"],
                   "verifications": r["num_verifications"], "verify_cost_in_plain_forwards": verify_cost(r)}
        if "lockstep_speedup" in r:
            metrics["lockstep_speedup"] = r["lockstep_speedup"]
        append_results("real_model_speculative", "cpu", params, metrics, _torch.__version__)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = cache_root() / "runs" / "cpu" / args.run / "speculative"
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarize_only:
        generate(args, out)
    rows = summarize(args, out)
    text = "\n".join([
        BEGIN, "", f"## Speculative decoding, measured (run `{args.run}`, RS, {args.precision})", "",
        f"Real speculative decoding with the trained MTP layer on the first {args.num_prompts} held-out prompts, "
        f"{args.max_new_tokens} new tokens each, on 2 shared CPU cores: per (prompt, T) plain decoding and then "
        "every gamma, same process, same KV-cache code. Intervals: 95% CLT over verifications (measured) or "
        "over positions (predicted). Speed-up: plain decode seconds per token / speculative decode seconds per "
        "token (prefill excluded), over all prompts together; the machine's load from other jobs changed within "
        "minutes, so the per-prompt ratios (in brackets) show how noisy a wall-time ratio is here. The lockstep "
        "column comes from a second run (`--lockstep`) that advanced plain and speculative decoding of each prompt "
        "in turn, one forward / verification each, on two caches of the same model (a later, less loaded "
        "machine). Verification cost: seconds per verification of gamma+1 tokens over seconds per plain "
        "one-token forward; the CPU is compute-bound, so it grows with gamma, unlike a GPU's memory-bound "
        "decode.", "",
        table(rows, args), "", END])
    print(text)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    if args.publish and rows:
        publish(rows, args, text)


if __name__ == "__main__":
    main()
