#!/usr/bin/env bash
# Vision-language GRPO on geometry3k (EasyR1's recipe) with mix-mode guidance: a Qwen2.5-VL-3B
# draft, 1 of each prompt's 8 responses whole from Qwen2.5-VL-7B (same tokenizer and image
# processor, checked before Ray starts). Images run in every rollout (README_guidance.md,
# "Vision-language models"): worker.rollout.offpolicy_guidance.mode=speculative as an override
# guides token by token with exact μ; DRAFT_ONLY=1 trains without guidance.
# Hardware: one node, 8 x 80 GB GPUs.
# Environment: MODEL_PATH, GUIDANCE_PATH, DRAFT_ONLY (0 or 1), TRAIN_FILES, VAL_FILES, N_GPUS (per
# node), NNODES, PYTHON. Extra arguments are key=value overrides (or --dry-run: check the config,
# models, data and reward without loading them, and print the final config).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/launcher_flags.sh"
guided=true
if flag_on DRAFT_ONLY "0 (default: 1 of 8 responses from the guidance, mix mode) or 1 (GRPO alone)"; then
    guided=false
fi
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" config="$ROOT/configs/guidance_mix.yaml" \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-VL-3B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}" \
    worker.rollout.offpolicy_guidance.enable="$guided" \
    data.train_files="${TRAIN_FILES:-hiyouga/geometry3k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/geometry3k@test}" \
    data.image_key=images data.min_pixels=262144 data.max_pixels=4194304 \
    data.max_prompt_length=2048 data.max_response_length=2048 \
    trainer.n_gpus_per_node="${N_GPUS:-8}" trainer.nnodes="${NNODES:-1}" \
    trainer.experiment_name=qwen2_5_vl_3b_geo3k_mix "$@"
