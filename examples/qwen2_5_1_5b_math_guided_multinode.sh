#!/usr/bin/env bash
# Guided GRPO, speculative mode, on a Ray cluster: start Ray on every node first
# (ray start --head on one, ray start --address=HEAD:6379 on the others), export RAY_ADDRESS, then
# run this on the head. Hardware: NNODES (default 2) nodes of 8 x 80 GB GPUs.
# Environment: MODEL_PATH, GUIDANCE_PATH, TRAIN_FILES, VAL_FILES, N_GPUS (per node), NNODES,
# PYTHON, GUIDANCE_GPUS (default 0: the guidance shares every GPU; 2: it gets 2 GPUs per node of
# its own and the FSDP ranks and draft engines the other N_GPUS - 2). Extra arguments are key=value overrides (or --dry-run: print the final config only).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" config="$ROOT/configs/guidance_speculative.yaml" \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-1.5B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-7B-Instruct}" \
    data.train_files="${TRAIN_FILES:-hiyouga/math12k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/math12k@test}" \
    trainer.n_gpus_per_node=$(( ${N_GPUS:-8} - ${GUIDANCE_GPUS:-0} )) \
    worker.rollout.offpolicy_guidance.n_gpus_per_node="${GUIDANCE_GPUS:-0}" trainer.nnodes="${NNODES:-2}" \
    trainer.experiment_name=qwen2_5_1_5b_math_guided_multinode "$@"
