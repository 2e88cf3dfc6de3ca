#!/usr/bin/env bash
# Every GPU check of this repository in one run on a machine with one NVIDIA GPU (H200 class),
# no internet, no Transformer Engine; each part has its own time limit (90 + 240 + 240 + 200 + 150 s at
# most, with >= 2 GPUs the cp part first, 150 s more): over one device call's 10 minutes, so split the parts
# over calls with --parts when the first ones run long.
#
#   benchmarks/gpu/run_all.sh [--out DIR]     # on the GPU machine, from anywhere
#   benchmarks/gpu/run_all.sh --dry-run       # CPU only, tiny sizes: checks that every part still runs
#   benchmarks/gpu/run_all.sh --parts generate   # only these parts (comma-separated names below)
#
# Parts (logs and a CSV land in DIR, default $OUT or benchmarks/gpu/out):
#   0. cp     benchmarks/bench_context_parallel.py --device cuda: context parallelism (NCCL) on one row of
#             32K, 64K, 128K tokens of a tiny model, C=1 (one GPU) and C=2 (two GPUs): step time, peak memory
#             per rank, C=2's losses against C=1's. First, and only on a machine with >= 2 GPUs (one line
#             says it was skipped otherwise); the dry run runs it at C=2 on two CPU ranks (gloo), tiny rows
#   1. loss   benchmarks/benchmark_tv_loss.py --impls torch,triton: the fused e2e TV loss, torch vs
#             Triton kernels, K=3 T=8192 H=4096 V=151936 bf16: time, peak memory, time / projection GEMMs,
#             and where each step's kernel time goes (--profile: GEMMs, Triton, reductions, elementwise)
#   2. step   benchmarks/gpu/bench_train_step.py: frozen-backbone steps of a 1.43B random dense model,
#             bf16, local layer spec: tokens/s, MFU, peak memory, before/after in one run: the unfused
#             attention at micro-batch 1 (the earlier runs), then SDPA at micro-batch 1 and 4
#   3. tests  pytest -m gpu tests/test_kernel_triton.py tests/test_lk_triton.py (the Triton kernels on CUDA,
#             production sizes; the TV+KL kind of lk / e2e_lk)
#   4. generate  benchmarks/bench_generate.py: tokens/s of the batched Megatron sampler (CUDA graphs off and
#             on) against transformers' generate, SmolLM2-135M (the carried .gpu_work/hf or $GENERATE_HF_DIR
#             when present, else its shape with random weights), bf16, batch 256
#   5. study  benchmarks/gpu/real_model.sh smoke: tools/objective_study.py on a random tiny Llama
#             (import, responses, both conditions, report) and the returned heads, bf16 on CUDA; its
#             files in a fresh temporary folder (its log in DIR/study.log)
# Rows go to DIR/results_gpu.csv (the GPU's name in the machine column); append them to
# benchmarks/results.csv with: tail -n +2 DIR/results_gpu.csv >> benchmarks/results.csv
#
# Python packages: the machine's python3 must have torch with CUDA and triton; megatron-core and
# omegaconf travel as wheels in .whl/ (benchmarks/README.md, "GPU
# script"): when .whl/ exists they are installed into /tmp/site first. The dry run installs nothing.
# Exit status: the number of parts that failed (0 = all passed).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dry=0
parts=cp,loss,step,tests,generate,study
outdir=${OUT:-$repo/benchmarks/gpu/out}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) [ $# -ge 2 ] || { echo "error: --out needs a directory" >&2; exit 2; }; outdir=$2; shift ;;
    --parts) [ $# -ge 2 ] || { echo "error: --parts needs a list, e.g. step,generate" >&2; exit 2; }; parts=$2; shift ;;
    -h|--help) sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument '$1' (use --dry-run, --out DIR, --parts LIST)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$outdir" || exit 2
outdir=$(cd "$outdir" && pwd)
cd "$repo" || exit 2
py=${PYTHON:-python3}

if [ $dry = 0 ] && [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing the wheels in .whl/ failed" >&2; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 BENCH_RESULTS_CSV=$outdir/results_gpu.csv

if [ $dry = 0 ]; then
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "error: no CUDA GPU visible to $py (use --dry-run for the CPU check)" >&2; exit 2; }
  "$py" -c "import megatron.core, omegaconf" \
    || { echo "error: megatron-core / omegaconf missing: carry them as wheels in .whl/ (benchmarks/README.md)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$outdir/gpu.txt"
  loss=(--impls torch,triton --device cuda --dtype bf16 --steps 3 --tokens 8192 --hidden 4096 --vocab 151936
        --iters 3 --warmup 1 --profile)
  step=(--device cuda --precision bf16 --variants unfused:1,sdpa:1,sdpa:4)
  tests=(-m gpu --durations=5 tests/test_kernel_triton.py tests/test_lk_triton.py)
  hf=${GENERATE_HF_DIR:-$repo/.gpu_work/hf}
  if [ -f "$hf/config.json" ]; then model=(--hf-dir "$hf"); else model=(--shape smollm2); fi
  generate=(--device cuda "${model[@]}" --batch-size 256 --num-prompts 512 --max-new-tokens 256 --prompt-words 20,200
            --variants hf,megatron,megatron_graphs)
  limits=(90 240 240 200 150)
  ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  cp=(--device cuda --seq 32768 65536 131072 --cp 1 2 --steps 3)
  cp_limit=150
else
  export BEBOP_ALLOW_SLOW_BF16=1  # bf16 on the CPU at tiny sizes: slow GEMMs do not matter here
  loss=(--impls torch --device cpu --dtype bf16 --steps 3 --tokens 48 --hidden 32 --vocab 500 --chunk-tokens 32
        --iters 1 --warmup 0 --profile)
  step=(--device cpu --precision bf16 --layers 2 --hidden 64 --ffn 128 --heads 4 --groups 2 --vocab 256 --seq 32
        --global-batch 4 --steps 1 --warmup 1 --variants unfused:1,sdpa:2)
  tests=(--collect-only -m gpu tests/test_kernel_triton.py tests/test_lk_triton.py)
  generate=(--device cpu --shape tiny --batch-size 4 --num-prompts 8 --max-new-tokens 8 --threads 1)
  limits=(300 300 300 300 300)  # hang guards only: a loaded 2-core machine took 83 s for the cp part
  ngpu=2  # stands in for a multi-GPU machine: the cp part runs on two CPU ranks
  cp=(--device cpu --dry-run --cp 2)
  cp_limit=300
fi

failed=0
for p in ${parts//,/ }; do
  case "$p" in cp|loss|step|tests|generate|study) ;;
    *) echo "error: unknown part '$p' (cp, loss, step, tests, generate, study)" >&2; exit 2 ;; esac
done
part() {  # name, time limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  case ",$parts," in *",$name,"*) ;; *) return 0 ;; esac
  echo "=== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$outdir/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$outdir/summary.txt"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}

: > "$outdir/summary.txt"
# Context parallelism needs one GPU per rank: the first thing a machine with >= 2 GPUs runs.
if [ "$ngpu" -ge 2 ]; then
  part cp "$cp_limit" "$py" benchmarks/bench_context_parallel.py "${cp[@]}"
elif [[ ",$parts," == *",cp,"* ]]; then
  echo "=== cp: skipped (context parallelism needs >= 2 GPUs; this machine has $ngpu)" | tee -a "$outdir/summary.txt"
fi
part loss "${limits[0]}" "$py" benchmarks/benchmark_tv_loss.py "${loss[@]}"
part step "${limits[1]}" "$py" benchmarks/gpu/bench_train_step.py "${step[@]}"
part tests "${limits[2]}" "$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
part generate "${limits[3]}" "$py" benchmarks/bench_generate.py "${generate[@]}"
if [[ ",$parts," == *",study,"* ]]; then
  study_work=$(mktemp -d "${TMPDIR:-/tmp}/bebop_study.XXXXXX") || exit 2
  part study "${limits[4]}" env WORK="$study_work" OUT="$study_work/out" PYTHON="$py" bash benchmarks/gpu/real_model.sh \
    smoke --device "$([ $dry = 0 ] && echo cuda || echo cpu)"
  rm -rf "$study_work"
fi
echo "=== $failed part(s) failed; results: $outdir/results_gpu.csv" | tee -a "$outdir/summary.txt"
exit $failed
