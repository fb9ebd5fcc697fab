#!/usr/bin/env bash
# The recipe behind `make demo`: guided GRPO on the embedded arithmetic task with tiny models
# built once under .cache/embedded/. Hardware: any CPU (2 cores take about 6 minutes, model build included); a GPU is
# used when present. Environment: PYTHON. Extra arguments are key=value overrides (or --dry-run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"  # the embedded models' paths are relative to the repository
${PYTHON:-python3} -m verl.trainer.main config="$ROOT/examples/grpo_guided.yaml" "$@"
