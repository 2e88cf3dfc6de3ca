"""Real speculative decoding here (CPU) with the heads the GPU study returned: measured against
predicted accepted length, the ce head against the study's best other head.

    .venv/bin/python benchmarks/gpu/real_model_speculative.py --from DIR [--num-prompts 32]
        [--max-new-tokens 128] [--temperatures 1 0.7] [--publish]

``DIR`` holds what ``benchmarks/gpu/real_model_study.py objective-study`` wrote to ``$OUT``,
among it the head files ``head_<condition>_<objective>_seed<S>.pt`` (MTP weights of the
tool's run checkpoints, ``real_model_heads.export_heads``). The backbone is rebuilt here from
the Megatron import of the same GGUF (``--model-dir``, default ``<cache>/smollm2-135m/megatron``:
``benchmarks/real_model/prepare.py``), fp32, and each head is loaded into its MTP block. The
prompts are the first ``--num-prompts`` of the study's held-out prompts (``--prompts``, default
``<cache>/smollm2-135m/prompts_gpu/heldout.jsonl``, the file the study carried), the backbone's
chat template, no response. For every head and temperature: rejection-sampling speculative
decoding with gamma 3 (``tools/speculative_generate.py``'s ``run_config``), the accepted drafts
per verification with a 95% interval, and the accepted length predicted from teacher-forced
acceptance on the same generations (Eq. 12); next to them the study's held-out E[L](3) RS of the
same head.

Resumable: every (head, T) result is ``DIR/speculative/<head>_T<T>.json``; a rerun skips the
finished ones. Written: ``DIR/speculative.md`` (the table); with ``--publish`` also the section in
the study's report ``DIR/RESULTS.md`` (between its markers) and rows of ``benchmarks/results.csv``
(benchmark ``real_model_gpu_speculative``). ``benchmarks/real_model/RESULTS_gpu.md`` is the old
study's report, kept as history: nothing is written there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, HERE, HERE.parent, HERE.parent / "real_model"):
    sys.path.insert(0, str(path))

from bebop_megatron import hub as models  # noqa: E402  (the model registry)
from real_model_files import SPEC, StudyError  # noqa: E402

BEGIN = "<!-- speculative: begin (benchmarks/gpu/real_model_speculative.py) -->"
END = "<!-- speculative: end -->"
HEADS = "head_*.pt"  # real_model_heads.export_heads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="src", required=True, help="the GPU study's returned files (head_*.pt)")
    p.add_argument("--model-dir", default=None, help="Megatron import of the backbone (default <cache>/megatron)")
    p.add_argument("--prompts", default=None, help="held-out prompts JSONL (default <cache>/prompts_gpu/heldout.jsonl)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--publish", action="store_true",
                   help="the section in DIR/RESULTS.md (the study's report) and rows of benchmarks/results.csv")
    args = p.parse_args(argv)
    cache = models.cache_root() / SPEC.name  # where benchmarks/real_model/prepare.py put the model
    args.model_dir = Path(args.model_dir or cache / "megatron")
    args.prompts = Path(args.prompts or cache / "prompts_gpu" / "heldout.jsonl")
    args.src = Path(args.src)
    return args


def check_inputs(args) -> list[Path]:
    heads = sorted(args.src.glob(HEADS))
    if not heads:
        raise StudyError(f"{args.src} holds no {HEADS}: pass the folder a GPU study (with heads) wrote")
    if not (args.model_dir / "bebop_model.yaml").is_file():
        raise StudyError(f"{args.model_dir} is not a Megatron import (no bebop_model.yaml): run "
                         "benchmarks/real_model/prepare.py, or pass --model-dir")
    if not args.prompts.is_file():
        raise StudyError(f"prompts file not found: {args.prompts} (pass --prompts)")
    return heads


def build_backbone(model_dir: Path):
    """``(model, cfg)``: the import's model at TP=1 in fp32 on the CPU, backbone loaded."""
    from bebop_megatron.config import load_config
    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.model_weights import load_model_weights
    from bebop_megatron.training.parallel import setup_parallel

    cfg = load_config(str(model_dir / "bebop_model.yaml"),
                      ["device=cpu", "precision=fp32", "model.transformer_impl=local",
                       f"model.backbone_checkpoint={model_dir}", "train.micro_batch_size=1",
                       "train.global_batch_size=1"])
    _, world = init_distributed("cpu")
    setup_parallel(cfg, world)
    model = build_model(cfg, "cpu")
    load_model_weights(str(model_dir), model, backbone_only=True)
    model.eval()
    return model, cfg


def run(args) -> list[dict]:
    from bebop_megatron.data.generate import read_prompts
    from bebop_megatron.data.tokenizer import tokenizer_from_dir
    from bebop_megatron.speculative.megatron_model import MegatronSpecModel
    from bebop_megatron.speculative.session import prompt_ids, run_config, stop_ids_of
    from real_model_heads import load_head

    heads = check_inputs(args)
    done_dir = args.src / "speculative"
    done_dir.mkdir(exist_ok=True)
    todo = [(h, t) for h in heads for t in args.temperatures
            if not (done_dir / f"{h.stem}_T{t:g}.json").is_file()]
    if todo:
        t0 = time.time()
        model, cfg = build_backbone(args.model_dir)
        tokenizer = tokenizer_from_dir(cfg.data.tokenizer)
        prompts = [prompt_ids(tokenizer, p.messages) for p in read_prompts(str(args.prompts), args.num_prompts).prompts]
        if len(prompts) < args.num_prompts:
            print(f"note: {args.prompts} holds {len(prompts)} prompts (asked {args.num_prompts})", file=sys.stderr)
        print(f"backbone built in {time.time() - t0:.0f} s; {len(todo)} (head, T) runs of {len(prompts)} prompts",
              file=sys.stderr, flush=True)
        weight = None
        for n, (head, tau) in enumerate(todo):
            record = load_head(head, model)
            spec = MegatronSpecModel(model, cfg.model.vocab_size, weight_VH=weight)
            weight = spec.weight_VH
            if args.gamma > spec.max_gamma():
                raise StudyError(f"--gamma {args.gamma} exceeds the head's {spec.num_steps} MTP steps")
            t1 = time.time()

            def progress(i, total, n=n, t1=t1):
                left = (time.time() - t1) / i * (total - i)
                print(f"[{n + 1}/{len(todo)}] {record['run']} T={tau:g}: prompt {i}/{total}, ETA {left:.0f} s",
                      file=sys.stderr, flush=True)

            result = run_config(spec, prompts, gamma=args.gamma, temperature=tau, mode="rs",
                                max_new_tokens=args.max_new_tokens, seed=args.seed,
                                stop_ids=stop_ids_of(tokenizer), progress=progress)
            result.pop("texts", None)
            result.update(head=head.name, run=record["run"], loss=record["loss"],
                          study=record["metrics"][_key(tau)], seconds=time.time() - t1)
            tmp = done_dir / f"{head.stem}_T{tau:g}.json.tmp"
            tmp.write_text(json.dumps(result, indent=1))
            os.replace(tmp, done_dir / f"{head.stem}_T{tau:g}.json")
    rows = [json.loads((done_dir / f"{h.stem}_T{t:g}.json").read_text()) for h in heads for t in args.temperatures]
    return rows


def _key(tau: float) -> str:
    return f"{tau:g}"  # the study's metrics are keyed "1" and "0.7"


def table(rows: list[dict], args) -> str:
    lines = [BEGIN, "", "## Real speculative decoding with the returned heads (CPU, fp32)", "",
             f"The GPU study's heads, decoding here on the CPU: rejection sampling, gamma {args.gamma}, "
             f"the first {rows[0]['num_prompts']} held-out prompts (chat template, no response), at most "
             f"{args.max_new_tokens} new tokens each, seed {args.seed} "
             "(`benchmarks/gpu/real_model_speculative.py`). Measured: drafts accepted per verification, 95% "
             "interval over verifications. Predicted: Eq. 12 from the teacher-forced acceptance of the same "
             "generations, at every position and at the positions where a verification started (the measured "
             "column's population). Study: the head's held-out E[L](3) RS at the same temperature (its own positions and "
             "responses).", "",
             "| head | loss | T | measured accepted / verification | predicted, every position | predicted, at "
             "verification starts | study E[L](3) RS | verifications | tokens / target forward |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = " [{:.3f}, {:.3f}]".format
        lines.append(f"| {r['run']} | {r['loss']} | {r['temperature']:g} | {r['measured_accept_len']:.3f}"
                     f"{ci(*r['ci95'])} | {r['predicted_accept_len']:.3f}{ci(*r['predicted_ci95'])} | "
                     f"{r['predicted_accept_len_at_starts']:.3f}{ci(*r['predicted_at_starts_ci95'])} | "
                     f"{r['study']['accept_len_rs_g3']:.3f} | "
                     f"{r['num_verifications']} | {r['tokens_per_target_forward']:.3f} |")
    return "\n".join(lines + ["", END])


def publish(rows: list[dict], args, text: str) -> None:
    import torch

    from common import append_results, replace_marked_section

    dest = args.src / "RESULTS.md"
    dest.write_text(replace_marked_section(dest.read_text() if dest.is_file() else "", text, BEGIN, END))
    for r in rows:
        params = {"model": "SmolLM2-135M-Instruct", "head": r["run"], "loss": r["loss"], "gamma": r["gamma"],
                  "T": r["temperature"], "mode": "rs", "prompts": r["num_prompts"],
                  "max_new_tokens": r["max_new_tokens"], "precision": "fp32"}
        metrics = {"measured_accept_len": r["measured_accept_len"], "measured_ci_lo": r["ci95"][0],
                   "measured_ci_hi": r["ci95"][1], "predicted_accept_len": r["predicted_accept_len"],
                   "predicted_accept_len_at_starts": r["predicted_accept_len_at_starts"],
                   "study_accept_len_rs_g3": r["study"]["accept_len_rs_g3"],
                   "tokens_per_target_forward": r["tokens_per_target_forward"],
                   "verifications": r["num_verifications"]}
        append_results("real_model_gpu_speculative", "cpu", params, metrics, torch.__version__)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        rows = run(args)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    text = table(rows, args)
    (args.src / "speculative.md").write_text(text + "\n")
    print(text)
    if args.publish:
        publish(rows, args, text)


if __name__ == "__main__":
    main()
