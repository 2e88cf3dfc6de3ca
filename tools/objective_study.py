"""Which objective trains the best MTP head on your model? Seeds as the unit of the intervals, decode-exact E[L].

    # a model by its registry name (bebop_megatron/hub.py) or an HF folder, prompts
    # (one JSONL file, or a folder of train.jsonl and heldout.jsonl): the model's own answers at T=1
    # are the data; 5 objectives x 3 seeds x 40k tokens, fresh heads
    python tools/objective_study.py --model smollm2-135m --prompts PROMPTS --work WORK \\
        --objectives ce,kl,e2e_tv,e2e_nla,e2e_lk --seeds 0,1,2 --tokens 40000
    # an import you already have, data the trainer reads, heads first trained with ce for 20k tokens
    python tools/objective_study.py --megatron IMPORT --train-data a.jsonl --heldout-data b.jsonl \\
        --conditions fresh,existing --existing ce:20000 --work WORK
    # the report again (of a finished or a partial study)
    python tools/objective_study.py --work WORK --report-only [same options]
    # carrying the study to another machine (no weights, no prompt text): pack WORK's state into DIR,
    # then, on the other machine, unpack it (checked against the prompts and the tokenizer) and go on
    python tools/objective_study.py --work WORK --pack DIR
    python tools/objective_study.py --unpack DIR [same options as the study]

Every flag and every run's trainer config are checked first, before any work; --work records the
model, import and prompts it was made from (WORK/fingerprint.json: a study of others there is
refused). Stages, each resumable from --work (a complete stage is skipped; run the same command
again after an interruption): the import (tools/convert_from_hf.py; none with --megatron); the
responses (batched transformers generate at T=1, train and held-out prompts disjoint; the held-out
prompts answered again at 0.7, so that each temperature's decode-exact forecast runs on text sampled at
it) and their indexed datasets; for the ``existing`` condition the seed's ce head; then every
(condition, seed, objective) run, in this process or, with --ranks N, in N processes at tensor
parallel N: the training with learning curves (the trainer's held-out pass on the T=1 text: alpha,
E[L] by Eq. 12 and the decode-exact E[L]), the held-out evaluation at T=1 and 0.7, each on its own
text (tools/eval_acceptance.py's statistics, per position, with the response of every position); last
the report in --out:
RESULTS.md (tables, paired differences against ce and kl with 95% t-intervals over seeds, a
hierarchical bootstrap check and the response-only interval; a recommendation line per condition
and temperature, none where the held-out text was sampled at another temperature; a partial study
names its missing runs), results.csv, curves_<condition>.png, summary.json. --pack DIR writes the
study's portable state (its responses without the prompts, the finished runs' records and rows,
MANIFEST.json) into DIR (new, empty or an earlier pack) and stops; --unpack DIR restores it into
--work before the stages (each response line rebuilt from --prompts and the model's tokenizer and
checked against the pack's sha256); the existing condition's ce heads are not packed (weights):
retrained when needed. See docs/study.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

OBJECTIVES = "ce,kl,e2e_tv,e2e_nla,e2e_lk"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("the model (--model or --hf-dir, --megatron, or --megatron with either)")
    m.add_argument("--model", help="a registry name of bebop_megatron/hub.py (fetched and dequantized "
                                   "into $BEBOP_CACHE/NAME/hf when missing)")
    m.add_argument("--hf-dir", help="a Hugging Face model folder (any family tools/convert_from_hf.py handles)")
    m.add_argument("--megatron", help="an import of tools/convert_from_hf.py (its MTP layers for --existing import); "
                                      "with --model or --hf-dir: the import of that model, which then only answers "
                                      "--prompts (no import stage)")
    m.add_argument("--mtp-num-steps", type=int, default=None,
                   help="MTP steps of the import (default 3); refused when the work folder's import has other "
                        "steps, or, given, when --megatron's has")
    d = p.add_argument_group("the data (one of)")
    d.add_argument("--prompts", help="prompts: one JSONL file (the first --num-heldout held out) or a folder of "
                                     "train.jsonl and heldout.jsonl; the model answers them at T=1 (needs --model or "
                                     "--hf-dir)")
    d.add_argument("--train-data", help="training files the trainer reads (comma-separated: JSONL, indexed, ...)")
    d.add_argument("--heldout-data", help="held-out files the trainer reads (comma-separated)")
    d.add_argument("--train-on", default="response", help="data.train_on of --train-data (default response)")
    d.add_argument("--num-train", type=int, default=1000)
    d.add_argument("--num-heldout", type=int, default=150)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--gen-batch-size", type=int, default=16)
    d.add_argument("--gen-precision", default="auto", choices=("auto", "fp32", "bf16"),
                   help="dtype of response generation (default auto: bf16 on cuda, fp32 on the CPU)")
    d.add_argument("--gen-budget-s", type=float, default=None, help="stop generating after this long (default: no limit)")
    d.add_argument("--gen-engine", choices=("hf", "megatron"), default="hf",
                   help="hf: transformers' generate; megatron: the project's batched sampler over the imported model "
                        "(GQA models, dense or MoE; same seeds and sampler; tools/generate_responses.py --megatron)")
    d.add_argument("--cuda-graphs", action="store_true", help="--gen-engine megatron on CUDA: CUDA-graph decode steps")
    s = p.add_argument_group("the study")
    s.add_argument("--work", required=True,
                   help="work folder: every stage resumes from it; it records what it was made from (WORK/"
                        "fingerprint.json: the model, the --megatron import, the prompts) and a study of other ones "
                        "is refused")
    s.add_argument("--out", default=None, help="report folder (default WORK/report)")
    s.add_argument("--objectives", default=OBJECTIVES, help=f"comma-separated loss.type values (default {OBJECTIVES})")
    s.add_argument("--conditions", default="fresh", help="fresh, existing or both (default fresh)")
    s.add_argument("--existing", default="import",
                   help="the existing condition's head: 'import' (the import's MTP layers) or 'ce:N' (a fresh head "
                        "first trained with ce for N tokens, per seed); default import")
    s.add_argument("--seeds", default="0", help="comma-separated seeds, 0 to 2**32 - 2 (default 0)")
    s.add_argument("--tokens", type=int, default=40_000, help="training tokens per run (default 40000)")
    s.add_argument("--lr", type=float, default=1e-3, help="fresh heads (cosine to lr/10; default 1e-3)")
    s.add_argument("--ft-lr", type=float, default=1e-4, help="existing heads (default 1e-4)")
    s.add_argument("--seq-length", type=int, default=1024)
    s.add_argument("--micro-batch-size", type=int, default=4)
    s.add_argument("--global-batch-size", type=int, default=8)
    s.add_argument("--warmup-fraction", type=float, default=0.05)
    s.add_argument("--curve-points", type=int, default=8, help="held-out passes per run (default 8)")
    s.add_argument("--curve-rows", type=int, default=64, help="held-out rows of each curve point (default 64)")
    s.add_argument("--loss-chunk-tokens", type=int, default=8192)
    s.add_argument("--eval-chunk-positions", type=int, default=4096)
    s.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    s.add_argument("--precision", default=None, help="default fp32 on cpu, bf16 on cuda")
    s.add_argument("--ranks", type=int, default=1,
                   help="processes per run, tensor parallel (default 1: in this process); N > 1: every run is N "
                        "processes of its own under torchrun (N must divide the model's key-value heads, FFN and "
                        "padded vocabulary), e.g. 2 on 2 CPU cores as benchmarks/README.md's command line trains "
                        "Qwen2.5-Coder-1.5B")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config override")
    s.add_argument("--seed", type=int, default=1234, help="seed of response generation (default 1234)")
    s.add_argument("--title", default="", help="the report's title (default: the model)")
    s.add_argument("--report-only", action="store_true", help="write the report of the finished runs and stop")
    s.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each finished run's last training checkpoint (RUN/ckpt: its MTP weights and optimizer, "
                        "what tools/convert_to_hf.py --checkpoint and tools/speculative_generate.py read); default: "
                        "removed once the run's record is written")
    s.add_argument("--num-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    s.add_argument("--verbose", action="store_true", help="the trainer's own lines")
    c = p.add_argument_group("carrying the study to another machine (docs/study.md)")
    c.add_argument("--pack", metavar="DIR",
                   help="write --work's portable state into DIR and stop (nothing is trained; DIR: a new or empty "
                        "folder, or an earlier pack, replaced atomically; anything else is refused, as is a DIR at, "
                        "inside or above --work): the responses without what their prompts give back (gzip), the "
                        "responses stage's files, every finished run's record.json and rows.npz, MANIFEST.json (the machine, "
                        "the date, the commit); not the import nor the existing condition's ce heads (weights: "
                        "retrained after an unpack); needs only --work (--prompts: its manifest.json is recorded)")
    c.add_argument("--unpack", metavar="DIR",
                   help="before the stages, restore a --pack DIR into --work: every response line rebuilt with its "
                        "prompt (--prompts, --num-train, --num-heldout) and its prompt_ids (the tokenizer of "
                        "--model/--hf-dir) and checked against the packed sha256 (a mismatch: one line, nothing "
                        "written), the finished runs restored (one already in --work must be the same), the pack's "
                        "manifest appended to WORK/provenance.jsonl; then the study goes on as usual")
    args = p.parse_args(argv)
    from bebop_megatron.study.log import StudyError

    if args.pack is not None and args.unpack is not None:
        raise StudyError("give --pack or --unpack, not both (--pack writes --work's state into DIR and stops; "
                         "--unpack restores a pack into --work before the study)")
    if args.pack is not None:
        return args  # needs only --work
    if args.model is not None and args.hf_dir is not None:
        p.error("give --model or --hf-dir, not both")
    if args.model is None and args.hf_dir is None and args.megatron is None:
        p.error("give one of --model, --hf-dir, --megatron")
    if args.prompts is not None and args.train_data is not None:
        raise StudyError("give --prompts or --train-data, not both (--prompts: the model answers them and the runs "
                         "train on its answers; --train-data: files the trainer reads as they are)")
    if args.prompts is None and args.train_data is None:
        p.error("give --prompts or --train-data (with --heldout-data)")
    if args.train_data is not None and args.heldout_data is None:
        p.error("--train-data needs --heldout-data")
    if args.prompts is not None and args.model is None and args.hf_dir is None:
        p.error("--prompts needs --model or --hf-dir (the responses are generated with transformers)")
    for name in ("num_train", "num_heldout", "max_new_tokens", "gen_batch_size", "tokens", "seq_length",
                 "micro_batch_size", "global_batch_size", "curve_points", "curve_rows", "loss_chunk_tokens",
                 "eval_chunk_positions", "num_boot", "mtp_num_steps", "ranks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("lr", "ft_lr"):
        if not 0 < getattr(args, name) < float("inf"):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if args.gen_budget_s is not None and not args.gen_budget_s > 0:
        p.error(f"--gen-budget-s must be positive, got {args.gen_budget_s}")
    if args.cuda_graphs and (args.gen_engine != "megatron" or args.device != "cuda"):
        p.error("--cuda-graphs needs --gen-engine megatron and --device cuda")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    args.mtp_steps_given = args.mtp_num_steps is not None
    args.mtp_num_steps = args.mtp_num_steps or 3
    from bebop_megatron.study.preflight import parse_seeds

    args.seed_list = parse_seeds(args.seeds)
    from bebop_megatron.study.driver import check_seeds

    check_seeds([args.seed], "--seed")
    from bebop_megatron.cli import check_output_dir

    check_output_dir(args.work, "--work")
    if args.out is not None:
        check_output_dir(args.out, "--out")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import time

    from bebop_megatron.study.driver import StudyPlan, check_plan, check_ranks, run_study
    from bebop_megatron.study.log import StudyError, log, set_log_file
    from bebop_megatron.study.preflight import check_before_work, split
    from bebop_megatron.study.report import write_report
    from bebop_megatron.study.stages import (heldout_files, model_folder, prompt_sets, stage_import,
                                             stage_responses, stage_tokenize)

    work = Path(args.work).resolve()
    if args.pack is not None:
        from bebop_megatron.study.pack import pack

        pack(work, Path(args.pack).resolve(), prompts=Path(args.prompts) if args.prompts else None)
        return
    out = Path(args.out).resolve() if args.out else work / "report"
    seeds = args.seed_list
    plan = StudyPlan(work=work, out=out, meg=Path(), train_files=[], valid_files=[], objectives=split(args.objectives),
                     conditions=split(args.conditions), existing=args.existing, seeds=seeds, tokens=args.tokens,
                     lr=args.lr, ft_lr=args.ft_lr, train_on=args.train_on, seq_length=args.seq_length,
                     micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                     warmup_fraction=args.warmup_fraction, curve_points=args.curve_points, curve_rows=args.curve_rows,
                     loss_chunk_tokens=args.loss_chunk_tokens, chunk_positions=args.eval_chunk_positions,
                     device=args.device, precision=args.precision, ranks=args.ranks, overrides=list(args.set),
                     keep_checkpoints=args.keep_checkpoints,
                     verbose=args.verbose,
                     title=args.title or args.model or Path(args.hf_dir or args.megatron).name)
    check_plan(plan)
    hf, sets, made_from = check_before_work(args, plan, work)
    from bebop_megatron.study import fingerprint
    from bebop_megatron.study.log import write_error

    try:  # the first writes: a place that cannot be written is one line here
        work.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "study.log", "a"):
            pass
        fingerprint.record(work, made_from)
    except OSError as err:
        name = Path(err.filename) if err.filename else None
        mine = name is not None and (name == out or out in name.parents)
        raise write_error(err, f"--out {out}" if mine else f"--work {work}") from None
    set_log_file(out / "study.log")
    t0 = time.time()
    if args.unpack is not None:  # before the stages: they then skip what the pack holds
        from bebop_megatron.study.pack import unpack

        unpack(work, Path(args.unpack).resolve(), sets=sets, hf=hf)
    if args.report_only:
        write_report(plan, num_boot=args.num_boot)
        return
    hf = hf or model_folder(args.model, args.hf_dir)
    plan.meg = Path(args.megatron).resolve() if args.megatron else stage_import(hf, work,
                                                                                 mtp_num_steps=args.mtp_num_steps)
    if args.megatron and hf is not None:
        log(f"import: {plan.meg} (given; the responses come from {hf})")
    if not (plan.meg / "bebop_model.yaml").is_file():
        raise StudyError(f"{plan.meg}: no bebop_model.yaml (not an import of tools/convert_from_hf.py)")
    check_ranks(plan)  # before the responses: a model that --ranks cannot split is refused at once
    if args.prompts:
        data = work / "data"
        sets = prompt_sets(Path(args.prompts), args.num_train, args.num_heldout)
        gen = stage_responses(hf, sets, data, device=args.device, seed=args.seed, max_new_tokens=args.max_new_tokens,
                              batch_size=args.gen_batch_size, dtype=args.gen_precision, engine=args.gen_engine,
                              cuda_graphs=args.cuda_graphs, heldout_temperatures=plan.temperatures,
                              deadline=None if args.gen_budget_s is None else time.time() + args.gen_budget_s)
        stage_tokenize(plan.meg, data)
        plan.train_files, plan.valid_files = [data / "train"], [data / "heldout"]
        plan.heldout_files = heldout_files(data, gen, plan.temperatures)
        plan.info["responses"] = gen
    else:
        plan.train_files, plan.valid_files = split(args.train_data), split(args.heldout_data)
    run_study(plan)
    write_report(plan, num_boot=args.num_boot)
    log(f"study done in {time.time() - t0:.0f} s; report in {out}")


def cli(argv: list[str] | None = None) -> None:
    """The command line (console script ``bebop-objective-study``)."""
    argv = sys.argv[1:] if argv is None else argv
    from bebop_megatron.cli import run_cli
    from bebop_megatron.study.preflight import guarded

    run_cli(lambda: guarded(main, argv))


if __name__ == "__main__":
    cli()
