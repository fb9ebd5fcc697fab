#!/usr/bin/env bash
# MENTOR's selective guidance (arXiv 2510.04140): Qwen2.5-1.5B-Instruct draft, Qwen2.5-7B-Instruct
# guidance, math12k. 12 responses per prompt: 4 guided where the draft's entropy is high, 8 draft-only.
# Hardware: one node, 8 x 80 GB GPUs (each holds an FSDP rank, a draft engine share and the guidance).
# Environment: MODEL_PATH, GUIDANCE_PATH, TRAIN_FILES, VAL_FILES, N_GPUS (per node), NNODES,
# PYTHON, GUIDANCE_GPUS (as in qwen2_5_1_5b_math_guided.sh; 128 x 12 = 1536 responses a step
# split over NNODES x (N_GPUS - GUIDANCE_GPUS) ranks: not with GUIDANCE_GPUS 1 or 3 on 8 GPUs),
# EXACT (default 0: MENTOR as published, no importance weights, configs/mentor.yaml; 1: with
# exact truncated importance weights, configs/mentor_exact.yaml). Extra arguments are key=value
# overrides (or --dry-run: check the config, models, data and reward without loading them, and
# print the final config).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/launcher_gpus.sh" 1  # checks N_GPUS, GUIDANCE_GPUS, NNODES; sets TRAIN_GPUS
source "$ROOT/scripts/launcher_flags.sh"
OVERLAY=mentor
if flag_on EXACT "0 (default: MENTOR as published, configs/mentor.yaml) or 1 (exact truncated importance weights, configs/mentor_exact.yaml)"; then
    OVERLAY=mentor_exact
fi
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" config="$ROOT/configs/$OVERLAY.yaml" \
    worker.rollout.n=12 \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-1.5B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-7B-Instruct}" \
    data.train_files="${TRAIN_FILES:-hiyouga/math12k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/math12k@test}" \
    trainer.n_gpus_per_node="$TRAIN_GPUS" \
    worker.rollout.offpolicy_guidance.n_gpus_per_node="$GUIDANCE_GPUS" trainer.nnodes="$NNODES" \
    worker.rollout.n_gpus_per_node="$DRAFT_GPUS" \
    trainer.experiment_name="qwen2_5_1_5b_math_$OVERLAY" "$@"
