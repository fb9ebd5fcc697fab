#!/usr/bin/env bash
# Guided GRPO with LoRA on the draft: Qwen2.5-7B-Instruct draft trained through rank-32 adapters
# (configs/lora.yaml: every Linear but the LM head, the base frozen, the reference = the base with
# the adapters off), Qwen2.5-14B-Instruct guidance, speculative mode, math12k. Each weight sync sends
# the merged weights of the adapted modules; an HF export holds the merged model and the adapter
# alone (lora_adapter/, PEFT's format).
# Hardware: one node, 8 x 80 GB GPUs; GUIDANCE_GPUS=2 gives the 14B guidance two GPUs of its own and
# the FSDP ranks and draft engines the other 6 (default 0: it shares every GPU).
# Environment: MODEL_PATH, GUIDANCE_PATH, TRAIN_FILES, VAL_FILES, N_GPUS (per node), NNODES, PYTHON,
# GUIDANCE_GPUS, LORA_RANK (default 32). The rollout_batch_size x n = 96 x 8 = 768 responses of a
# step split evenly over the ranks. Extra arguments are key=value overrides (or --dry-run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/launcher_gpus.sh" 1  # checks N_GPUS, GUIDANCE_GPUS, NNODES; sets TRAIN_GPUS
RANK=${LORA_RANK:-32}
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" config="$ROOT/configs/guidance_speculative.yaml" \
    config="$ROOT/configs/lora.yaml" \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-14B-Instruct}" \
    data.train_files="${TRAIN_FILES:-hiyouga/math12k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/math12k@test}" \
    worker.actor.model.lora.rank="$RANK" worker.actor.model.lora.alpha="$((2 * RANK))" \
    data.rollout_batch_size=96 \
    trainer.n_gpus_per_node="$TRAIN_GPUS" \
    worker.rollout.offpolicy_guidance.n_gpus_per_node="$GUIDANCE_GPUS" trainer.nnodes="$NNODES" \
    worker.rollout.n_gpus_per_node="$DRAFT_GPUS" \
    trainer.experiment_name=qwen2_5_7b_math_lora_guided "$@"
