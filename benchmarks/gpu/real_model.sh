#!/usr/bin/env bash
# The real-model objective study (SmolLM2-135M-Instruct) on the GPU machine: tools/objective_study.py
# on the carried model and prompts, in back-to-back calls that keep the machine warm (its ignored
# files stay between them). Prepared here with
#   .venv/bin/python benchmarks/gpu/real_model_study.py carry      # .gpu_carry1/ and .gpu_carry2/ (ignored)
# then, on the GPU machine (device tool; benchmarks/README.md, "Real-model study on a GPU"):
#   benchmarks/gpu/real_model.sh part 1 [--smoke]     # carry .whl .gpu_carry1: wheels, part 1, prompts
#                                                     # (--smoke: the tool's tiny dry run on the GPU)
#   benchmarks/gpu/real_model.sh part 2 [TOOL ARGS]   # carry .gpu_carry2: part 2, reassembly, then the study
#   benchmarks/gpu/real_model.sh study [TOOL ARGS]    # the study alone (it resumes from .gpu_work/)
# TOOL ARGS: tools/objective_study.py's options (docs/study.md), e.g. --seeds 0,1,2 --tokens 1000000.
# Results land in $OUT (RESULTS.md, results.csv, curves_*.png, summary.json, study.log, head_*.pt);
# real speculative decoding with the heads here: benchmarks/speculative.py --heads DIR
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo" || exit 2
py=${PYTHON:-python3}
site=$repo/.gpu_work/site
export PYTHONUNBUFFERED=1

install_wheels() {
  [ -d .whl ] || return 0
  [ -f "$site/.complete" ] && return 0
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "error: installing the wheels in .whl/ failed" >&2; exit 2; }
  touch "$site/.complete"
}

[ $# -ge 1 ] || { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }
what=$1
shift
install_wheels
export PYTHONPATH=$site:$repo${PYTHONPATH:+:$PYTHONPATH}
case "$what" in
  part)
    [ $# -ge 1 ] || { echo "error: part needs 1 or 2" >&2; exit 2; }
    n=$1
    shift
    "$py" benchmarks/gpu/real_model_study.py receive --part "$n" || exit $?
    if [ "$n" = 1 ] && [ "${1:-}" = --smoke ]; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      "$py" benchmarks/gpu/real_model_study.py objective-study --dry-run --device cuda \
        --work .gpu_work/smoke --out "${OUT:-benchmarks/gpu/out}/smoke" || exit $?
    elif [ "$n" = 2 ]; then
      exec "$py" benchmarks/gpu/real_model_study.py objective-study "$@"
    fi
    ;;
  study) exec "$py" benchmarks/gpu/real_model_study.py objective-study "$@" ;;
  -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
  *) echo "error: unknown command '$what' (part 1|2, study)" >&2; exit 2 ;;
esac
