#!/usr/bin/env bash
# Guided GRPO on the embedded vision task (`count`: how many squares a picture holds):
# examples/grpo_guided.yaml with the examples/count_guided.yaml overlay. A tiny Qwen2.5-VL draft is
# guided token by token by a stronger tiny Qwen2.5-VL; both engines and the actor see the pictures.
# The tiny models are built once under .cache/embedded/count/.
# Hardware: any CPU. Environment: PYTHON. Extra arguments are key=value overrides (or --dry-run),
# e.g. worker.rollout.offpolicy_guidance.enable=false for plain GRPO with images.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"  # the embedded models' paths are relative to the repository
${PYTHON:-python3} -m verl.trainer.main config="$ROOT/examples/grpo_guided.yaml" \
  config="$ROOT/examples/count_guided.yaml" "$@"
