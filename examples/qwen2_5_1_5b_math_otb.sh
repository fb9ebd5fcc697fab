#!/usr/bin/env bash
# GRPO samples with the optimal token baseline (OTB) as advantage, guidance off.
# Hardware: one node, 8 x 80 GB GPUs.
# Environment: MODEL_PATH, GUIDANCE_PATH, TRAIN_FILES, VAL_FILES, N_GPUS (per node), NNODES,
# PYTHON. Extra arguments are key=value overrides (or --dry-run: check the config, models, data
# and reward without loading them, and print the final config).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" config="$ROOT/configs/otb.yaml" \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-1.5B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-7B-Instruct}" \
    data.train_files="${TRAIN_FILES:-hiyouga/math12k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/math12k@test}" \
    trainer.n_gpus_per_node="${N_GPUS:-8}" trainer.nnodes="${NNODES:-1}" \
    trainer.experiment_name=qwen2_5_1_5b_math_otb "$@"
