#!/usr/bin/env bash
# The real-model objective study (SmolLM2-135M-Instruct) on the GPU machine, in back-to-back calls
# that keep the machine warm (its ignored files stay between them). Prepared here with
#   .venv/bin/python benchmarks/gpu/real_model_study.py carry      # .gpu_carry1/ and .gpu_carry2/ (ignored)
# then, on the GPU machine (device tool; benchmarks/README.md, "Real-model study on a GPU"):
#   benchmarks/gpu/real_model.sh part 1 [--smoke]     # carry .whl .gpu_carry1: wheels, part 1, prompts
#                                                     # (--smoke: the study's tiny dry run on the GPU)
#   benchmarks/gpu/real_model.sh part 2 [STUDY ARGS]  # carry .gpu_carry2: part 2, reassembly, then the study
#   benchmarks/gpu/real_model.sh study [STUDY ARGS]   # the study alone (it resumes from .gpu_work/)
#   benchmarks/gpu/real_model.sh objective-study [TOOL ARGS]  # instead: tools/objective_study.py on the
#                                                     # carried model and prompts (docs/study.md)
# Results land in $OUT (summary.json, positions_*.npz, study.log); turn them into tables here with
#   .venv/bin/python benchmarks/gpu/real_model_report.py --from DIR --publish
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
      "$py" benchmarks/gpu/real_model_study.py study --dry-run --device cuda --precision bf16 \
        --work .gpu_work/smoke --out "${OUT:-benchmarks/gpu/out}/smoke" --objectives ce,e2e_tv || exit $?
    elif [ "$n" = 2 ]; then
      exec "$py" benchmarks/gpu/real_model_study.py study "$@"
    fi
    ;;
  study) exec "$py" benchmarks/gpu/real_model_study.py study "$@" ;;
  objective-study) exec "$py" benchmarks/gpu/real_model_study.py objective-study "$@" ;;
  -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
  *) echo "error: unknown command '$what' (part 1|2, study, objective-study)" >&2; exit 2 ;;
esac
