#!/usr/bin/env bash
# Guided GRPO, speculative mode: Qwen2.5-1.5B-Instruct draft, Qwen2.5-7B-Instruct guidance, math12k.
# Hardware: one node, 8 x 80 GB GPUs (each holds an FSDP rank, a draft engine share and the guidance).
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
    worker.rollout.offpolicy_guidance.n_gpus_per_node="${GUIDANCE_GPUS:-0}" trainer.nnodes="${NNODES:-1}" \
    trainer.experiment_name=qwen2_5_1_5b_math_guided "$@"
