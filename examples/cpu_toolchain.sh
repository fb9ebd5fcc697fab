#!/usr/bin/env bash
# Guided GRPO on the embedded multi-turn tool task (`toolchain`): examples/grpo_guided.yaml with
# the examples/toolchain_guided.yaml overlay (multi-turn, the `lookup` tool, every policy turn
# guided token by token). The tiny models are built once under .cache/embedded/toolchain/.
# Hardware: any CPU. Environment: PYTHON. Extra arguments are key=value overrides (or --dry-run),
# e.g. worker.rollout.offpolicy_guidance.enable=false for plain multi-turn GRPO.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"  # the embedded models' paths are relative to the repository
${PYTHON:-python3} -m verl.trainer.main config="$ROOT/examples/grpo_guided.yaml" \
  config="$ROOT/examples/toolchain_guided.yaml" "$@"
