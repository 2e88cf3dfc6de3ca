"""Which objective trains the best MTP head on your model? Seeds, intervals over responses, decode-exact E[L].

    # a model by its registry name (benchmarks/real_model/models.py) or an HF folder, prompts
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
responses (batched transformers generate at T=1, train and held-out prompts disjoint) and their indexed
datasets; for the ``existing`` condition the seed's ce head; then every (condition, seed,
objective) run, in this process or, with --ranks N, in N processes at tensor parallel N: the
training with learning curves (the trainer's held-out pass: alpha, E[L] by Eq. 12 and the
decode-exact E[L]), the held-out evaluation at T=1 and 0.7 (tools/eval_acceptance.py's
statistics, per position, with the response of every position); last the report in --out:
RESULTS.md (tables, paired differences against ce and kl with 95% intervals from a bootstrap over
responses and seeds, a recommendation line per condition), results.csv, curves_<condition>.png,
summary.json. --pack DIR writes the study's portable state (its responses without the prompts, the
finished runs' records and rows, MANIFEST.json) into DIR (new, empty or an earlier pack) and
stops; --unpack DIR restores it into --work before the stages (each response line rebuilt from
--prompts and the model's tokenizer and checked against the pack's sha256); the existing
condition's ce heads are not packed (weights): retrained when needed. See docs/study.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OBJECTIVES = "ce,kl,e2e_tv,e2e_nla,e2e_lk"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("the model (--model or --hf-dir, --megatron, or --megatron with either)")
    m.add_argument("--model", help="a registry name of benchmarks/real_model/models.py (fetched and dequantized "
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
                        "padded vocabulary), e.g. 2 on 2 CPU cores as benchmarks/real_model/run_objectives.py trains "
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
    args.seed_list = parse_seeds(args.seeds)
    from bebop_megatron.study.driver import check_seeds

    check_seeds([args.seed], "--seed")
    from bebop_megatron.cli import check_output_dir

    check_output_dir(args.work, "--work")
    if args.out is not None:
        check_output_dir(args.out, "--out")
    return args


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: distinct integers from 0 to 2**32 - 2, comma-separated."""
    from bebop_megatron.study.driver import check_seeds
    from bebop_megatron.study.log import StudyError

    try:
        seeds = [int(x) for x in (x.strip() for x in text.split(",")) if x]
    except ValueError:
        raise StudyError(f"--seeds {text!r}: comma-separated integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise StudyError(f"--seeds {text!r}: distinct integers, at least one")
    check_seeds(seeds)
    return seeds


def check_before_work(args, plan, work: Path) -> tuple[Path | None, dict | None, dict]:
    """Every check that needs no work, before the first write: the prompts, the model, what the
    work folder was made from (:mod:`bebop_megatron.study.fingerprint`), the import's MTP steps,
    every run's trainer config (:func:`bebop_megatron.study.driver.check_configs`). Returns the
    model folder, the prompt sets and the fingerprint to record."""
    from bebop_megatron.study import fingerprint
    from bebop_megatron.study.driver import check_configs, check_flags
    from bebop_megatron.study.log import StudyError
    from bebop_megatron.study.stages import import_sections, import_steps, is_done, prompt_sets

    if not args.report_only:
        check_flags(plan)  # before a registry model is fetched
    sets = prompt_sets(Path(args.prompts), args.num_train, args.num_heldout) if args.prompts else None
    if args.report_only and args.unpack is None:  # nothing is generated: a model only where it is at hand
        hf = Path(args.hf_dir) if args.hf_dir and (Path(args.hf_dir) / "config.json").is_file() else None
    else:
        hf = model_folder(args)
    given = Path(args.megatron).resolve() if args.megatron else None
    current = {
        "model": fingerprint.folder_fingerprint(hf) if hf is not None else None,
        "import": fingerprint.folder_fingerprint(given, recursive=True) if given and given.is_dir() else None,
        "prompts": None if sets is None else fingerprint.prompts_fingerprint(
            sets, f"{Path(args.prompts).resolve()} (--num-train {args.num_train}, --num-heldout {args.num_heldout})"),
    }
    record = fingerprint.check(work, current)
    if args.report_only:
        return hf, sets, record
    meg = given or work / "megatron"
    have = import_steps(meg) if given or is_done(meg) else None
    if have is not None and have != args.mtp_num_steps and (args.mtp_steps_given or not given):
        where = f"--megatron {meg}" if given else f"this work folder's import {meg}"
        raise StudyError(f"--mtp-num-steps {args.mtp_num_steps}{'' if args.mtp_steps_given else ' (the default)'}: "
                         f"{where} has mtp.num_steps={have} (its bebop_model.yaml): give --mtp-num-steps {have}, "
                         + ("or another import" if given else f"or another --work to import again with "
                                                               f"{args.mtp_num_steps}"))
    plan.meg = meg
    if args.train_data is not None:
        plan.train_files, plan.valid_files = split(args.train_data), split(args.heldout_data)
    sections = None
    if not (meg / "bebop_model.yaml").is_file() and not given:
        sections = import_sections(hf, args.mtp_num_steps)
    check_configs(plan, sections=sections)
    return hf, sets, record


def split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run(argv=None) -> None:
    """:func:`main`; a write the file system refuses is one line, never a traceback: exit 74 when
    the disk failed (no space left, quota, I/O: :class:`~bebop_megatron.study.log.StudyDiskError`,
    as the trainer's), 2 for the place (read-only, permissions, a file in the way)."""
    from bebop_megatron.study.log import DISK_ERRNOS, WRITE_ERRNOS, write_error
    from bebop_megatron.study.stages import write_problem

    try:
        main(argv)
    except OSError as err:
        if err.errno not in DISK_ERRNOS and err.errno not in WRITE_ERRNOS:
            raise
        write_problem(err)  # drops the frames' locals now (see there)
        raise write_error(err, "the study") from None


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def registry_model(name: str) -> Path:
    """The HF folder of a registry model: ``$BEBOP_CACHE/NAME/hf``, fetched and dequantized when missing."""
    from bebop_megatron.study.log import StudyError, log
    from bebop_megatron.study.stages import is_done, mark_done

    models = _load("models", REPO / "benchmarks" / "real_model" / "models.py")
    if name not in models.MODELS:
        raise StudyError(f"--model {name!r}: not in the registry ({', '.join(models.MODELS)}); or give --hf-dir")
    spec = models.MODELS[name]
    cache = models.cache_root() / spec.name
    hf = cache / "hf"
    if not is_done(hf):
        try:
            models.dequantize(models.fetch_gguf(spec, cache, log=log), hf, spec.hf_class, log=log)
        except models.ModelError as err:
            raise StudyError(str(err)) from None
        mark_done(hf)
    return hf


def model_folder(args) -> Path | None:
    """The HF folder of --model or --hf-dir (None: neither)."""
    from bebop_megatron.study.log import StudyError

    hf = registry_model(args.model) if args.model else Path(args.hf_dir) if args.hf_dir else None
    if hf is not None and not (hf / "config.json").is_file():
        raise StudyError(f"{hf}: no config.json (not a Hugging Face model folder)")
    return hf


def main(argv=None) -> None:
    args = parse_args(argv)
    import time

    from bebop_megatron.study.driver import StudyPlan, check_plan, check_ranks, run_study
    from bebop_megatron.study.log import StudyError, log, set_log_file
    from bebop_megatron.study.report import write_report
    from bebop_megatron.study.stages import prompt_sets, stage_import, stage_responses, stage_tokenize

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
    hf = hf or model_folder(args)
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
                              cuda_graphs=args.cuda_graphs,
                              deadline=None if args.gen_budget_s is None else time.time() + args.gen_budget_s)
        stage_tokenize(plan.meg, data)
        plan.train_files, plan.valid_files = [data / "train"], [data / "heldout"]
        plan.info["responses"] = gen
    else:
        plan.train_files, plan.valid_files = split(args.train_data), split(args.heldout_data)
    sys.path.insert(0, str(REPO / "tools"))
    from eval_acceptance import micro_batch_statistics

    run_study(plan, micro_batch_statistics)
    write_report(plan, num_boot=args.num_boot)
    log(f"study done in {time.time() - t0:.0f} s; report in {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from bebop_megatron.cli import run_cli

    run_cli(lambda: run(sys.argv[1:]))
