#!/usr/bin/env bash
# Guided GRPO, speculative mode: Qwen2.5-1.5B-Instruct draft, Qwen2.5-7B-Instruct guidance, math12k.
# Hardware: one node, 8 x 80 GB GPUs (each holds an FSDP rank, a draft engine share and the guidance).
# Environment: MODEL_PATH, GUIDANCE_PATH, TRAIN_FILES, VAL_FILES, N_GPUS (per node), NNODES,
# PYTHON, GUIDANCE_GPUS (default 0: the guidance shares every GPU; 2: it gets 2 GPUs per node of
# its own and the FSDP ranks and draft engines the other N_GPUS - 2; at most N_GPUS - 1). The
# rollout_batch_size x n = 128 x 8 = 1024 responses of a step must split evenly over the
# NNODES x (N_GPUS - GUIDANCE_GPUS) ranks: GUIDANCE_GPUS=2 on 8 GPUs (6 ranks) needs e.g.
# data.rollout_batch_size=96 (0, 4 and 6 split as they are). Extra arguments are key=value
# overrides (or --dry-run: check the config, models, data and reward without loading them, and
# print the final config).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/launcher_gpus.sh" 1  # checks N_GPUS, GUIDANCE_GPUS, NNODES; sets TRAIN_GPUS
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" config="$ROOT/configs/guidance_speculative.yaml" \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-1.5B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-7B-Instruct}" \
    data.train_files="${TRAIN_FILES:-hiyouga/math12k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/math12k@test}" \
    trainer.n_gpus_per_node="$TRAIN_GPUS" \
    worker.rollout.offpolicy_guidance.n_gpus_per_node="$GUIDANCE_GPUS" trainer.nnodes="$NNODES" \
    worker.rollout.n_gpus_per_node="$DRAFT_GPUS" \
    trainer.experiment_name=qwen2_5_1_5b_math_guided "$@"
