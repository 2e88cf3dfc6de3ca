"""Real speculative decoding of trained MTP heads: measured accepted length against its predictions.

    # run checkpoints (tools/objective_study.py --keep-checkpoints keeps WORK/runs/<condition>/
    # <objective>/seed<S>/ckpt) or anything else tools/speculative_generate.py --checkpoint reads
    .venv/bin/python benchmarks/speculative.py --checkpoint WORK/runs/fresh/ce/seed0/ckpt [CKPT ...] \\
        --prompts PROMPTS/heldout.jsonl --out DIR [--gammas 1 2 3] [--temperatures 1 0.7] [--baseline]
    # the head files the GPU study returned (benchmarks/gpu/real_model_heads.py), on the backbone
    # imported here from the same GGUF (--backbone: a tools/convert_from_hf.py import)
    .venv/bin/python benchmarks/speculative.py --heads DIR --backbone IMPORT --prompts FILE --out DIR

The one harness over ``tools/speculative_generate.py``'s logic (``bebop_megatron.speculative``),
fp32 on the CPU: per head, gamma and temperature, rejection sampling over the first
``--num-prompts`` prompts; measured against Eq. 12 and the decode-exact forecast on the same texts,
the run's held-out E[L](gamma) RS (its ``record.json``) and with ``--baseline`` the speed-up
(benchmarks/README.md). Resumable: a unit is ``OUT/<head>_g<gamma>_T<T>.json``; the table is
``OUT/speculative.md``; ``--publish FILE`` puts it into FILE between the markers and appends rows
to ``benchmarks/results.csv`` (``--benchmark``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "gpu"))

from bebop_megatron.study.log import StudyError as HarnessError  # noqa: E402  (a ValueError: one error line)

BEGIN, END = "<!-- speculative: begin (benchmarks/speculative.py) -->", "<!-- speculative: end -->"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", nargs="+", default=[], help="training checkpoints or full exports")
    src.add_argument("--heads", default=None, help="a folder of head_*.pt files (with --backbone)")
    p.add_argument("--backbone", default=None, help="the Megatron import the heads belong to (with --heads)")
    p.add_argument("--prompts", required=True, help="prompts (or data) JSONL")
    p.add_argument("--out", required=True, help="the units' JSON files and speculative.md")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gammas", type=int, nargs="+", default=[3])
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true", help="also plain decoding in lockstep: the speed-up")
    p.add_argument("--publish", default=None, metavar="FILE", help="the table into FILE, rows into results.csv")
    p.add_argument("--benchmark", default="real_model_speculative", help="results.csv's benchmark column")
    args = p.parse_args(argv)
    if (args.heads is None) != (args.backbone is None):
        p.error("--heads and --backbone go together")
    if min(args.num_prompts, args.max_new_tokens, *args.gammas) < 1:
        p.error("--num-prompts, --max-new-tokens and --gammas must be >= 1")
    return args


def run_name(ckpt: Path) -> str:
    """``fresh_ce_seed0`` for the study's ``runs/fresh/ce/seed0/ckpt``, else the folder's name."""
    ckpt = ckpt.resolve()
    return "_".join(p.name for p in ckpt.parents[2::-1]) if ckpt.name == "ckpt" else ckpt.name


def sources(args) -> list[tuple[str, Path]]:
    if args.heads is not None:
        heads = sorted(Path(args.heads).glob("head_*.pt"))
        if not heads:
            raise HarnessError(f"{args.heads} holds no head_*.pt: pass the folder a GPU study (with heads) wrote")
        if not (Path(args.backbone) / "bebop_model.yaml").is_file():
            raise HarnessError(f"{args.backbone} is not a Megatron import (no bebop_model.yaml)")
        return [(h.stem[len("head_"):], h) for h in heads]
    return [(run_name(Path(c)), Path(c)) for c in args.checkpoint]


def backbone(model_dir: Path):
    """``(model, cfg)``: the import's model at TP=1 in fp32 on the CPU, backbone loaded."""
    from bebop_megatron.config import load_config
    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.model_weights import load_model_weights
    from bebop_megatron.training.parallel import setup_parallel

    cfg = load_config(str(model_dir / "bebop_model.yaml"), ["device=cpu", "precision=fp32", "model.transformer_impl=local",
                      f"model.backbone_checkpoint={model_dir}", "train.micro_batch_size=1", "train.global_batch_size=1"])
    setup_parallel(cfg, init_distributed("cpu")[1])
    model = build_model(cfg, "cpu")
    load_model_weights(str(model_dir), model, backbone_only=True)
    return model.eval(), cfg


def load(kind_heads: bool, path: Path, args, cache: dict):
    """``(spec model, cfg, record)``: a head loaded into the one backbone, or a checkpoint."""
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel
    from bebop_megatron.speculative.session import load as load_checkpoint

    if kind_heads:
        from real_model_heads import load_head

        if "model" not in cache:
            cache["model"], cache["cfg"] = backbone(Path(args.backbone))
        model, cfg = cache["model"], cache["cfg"]
        record = load_head(path, model)
    else:
        cache.clear()
        model, cfg = load_checkpoint(str(path), "cpu", precision="fp32")
        rec = path.resolve().parent / "record.json"
        record = json.loads(rec.read_text()) if rec.is_file() else {"loss": cfg.loss.type, "metrics": {}}
    spec = MegatronSpecModel(model, cfg.model.vocab_size, weight_VH=cache.get("weight"))
    cache["weight"] = spec.weight_VH if kind_heads else None
    return spec, cfg, record


def run(args) -> list[dict]:
    from bebop_megatron.data.generate import read_prompts
    from bebop_megatron.data.tokenizer import tokenizer_from_dir
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel
    from bebop_megatron.speculative.session import prompt_ids, run_config, stop_ids_of

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    units = [(name, path, g, t) for name, path in sources(args) for g in args.gammas for t in args.temperatures]
    unit_file = lambda name, g, t: out / f"{name}_g{g}_T{t:g}.json"  # noqa: E731
    cache, loaded = {}, None
    for n, (name, path, gamma, tau) in enumerate(units):
        if unit_file(name, gamma, tau).is_file():
            continue
        if loaded != path:
            spec, cfg, record = load(args.heads is not None, path, args, cache)
            tokenizer = tokenizer_from_dir(cfg.data.tokenizer)
            prompts = [prompt_ids(tokenizer, p.messages)
                       for p in read_prompts(args.prompts, args.num_prompts, drop_response=True).prompts]
            loaded = path
        if gamma > spec.max_gamma():
            raise HarnessError(f"gamma {gamma} exceeds {name}'s {spec.num_steps} MTP steps")
        t0 = time.time()
        result = run_config(spec, prompts, gamma=gamma, temperature=tau, mode="rs", max_new_tokens=args.max_new_tokens,
                            seed=args.seed, stop_ids=stop_ids_of(tokenizer), baseline=args.baseline,
                            baseline_model=MegatronSpecModel(spec.model, cfg.model.vocab_size,
                                                             weight_VH=spec.weight_VH) if args.baseline else None,
                            progress=lambda i, k: print(f"[{n + 1}/{len(units)}] {name} gamma {gamma} T={tau:g}: "
                                                        f"prompt {i}/{k}", file=sys.stderr, flush=True))
        result.pop("texts", None)
        result.update(head=name, loss=record["loss"], seconds=time.time() - t0,
                      study=record["metrics"].get(f"{tau:g}", {}).get(f"accept_len_rs_g{gamma}"))
        tmp = unit_file(name, gamma, tau).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, unit_file(name, gamma, tau))
    return [json.loads(unit_file(name, g, t).read_text()) for name, _, g, t in units]


def table(rows: list[dict], args) -> str:
    ci = lambda v, c: "n/a" if v is None else f"{v:.3f}" + ("" if c[0] is None else f" [{c[0]:.3f}, {c[1]:.3f}]")  # noqa: E731
    lines = [BEGIN, "", "## Real speculative decoding (CPU, fp32)", "",
             f"Rejection sampling over the first {rows[0]['num_prompts']} prompts of `{Path(args.prompts).name}`, at "
             f"most {args.max_new_tokens} new tokens each, seed {args.seed} (`benchmarks/speculative.py`). Measured: "
             "drafts accepted per verification, 95% interval over verifications. Eq. 12: from the teacher-forced "
             "acceptance on the same texts, at every position and at the verification starts. Decode-exact: the "
             "forecast from the same texts (bootstrap over prompts). Study: the run's held-out E[L](gamma) RS.", "",
             "| head | loss | gamma | T | measured | Eq. 12, every position | Eq. 12, verification starts | "
             "decode-exact | study | verifications | tokens / target forward | speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        study = "n/a" if r["study"] is None else f"{r['study']:.3f}"
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "n/a"
        lines.append(f"| {r['head']} | {r['loss']} | {r['gamma']} | {r['temperature']:g} | "
                     f"{ci(r['measured_accept_len'], r['ci95'])} | {ci(r['predicted_accept_len'], r['predicted_ci95'])} "
                     f"| {ci(r['predicted_accept_len_at_starts'], r['predicted_at_starts_ci95'])} | "
                     f"{ci(r['predicted_accept_len_decode'], r['predicted_decode_ci95'])} | {study} | "
                     f"{r['num_verifications']} | {r['tokens_per_target_forward']:.3f} | {speedup} |")
    return "\n".join(lines + ["", END])


def publish(rows: list[dict], args, text: str) -> None:
    import torch

    from common import append_results, replace_marked_section

    dest = Path(args.publish)
    dest.write_text(replace_marked_section(dest.read_text() if dest.is_file() else "", text, BEGIN, END))
    for r in rows:
        params = {"head": r["head"], "loss": r["loss"], "gamma": r["gamma"], "T": r["temperature"], "mode": "rs",
                  "prompts": r["num_prompts"], "max_new_tokens": r["max_new_tokens"], "precision": "fp32"}
        metrics = {"measured_ci_lo": r["ci95"][0], "measured_ci_hi": r["ci95"][1], "study_accept_len_rs": r["study"],
                   "verifications": r["num_verifications"], **{k: r.get(k) for k in (
                       "measured_accept_len", "predicted_accept_len", "predicted_accept_len_at_starts",
                       "predicted_accept_len_decode", "tokens_per_target_forward", "speedup")}}
        append_results(args.benchmark, "cpu", params, {k: v for k, v in metrics.items() if v is not None},
                       torch.__version__)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = run(args)
    text = table(rows, args)
    (Path(args.out) / "speculative.md").write_text(text + "\n")
    print(text)
    if args.publish:
        publish(rows, args, text)


if __name__ == "__main__":
    from bebop_megatron.cli import run_cli

    run_cli(main)
