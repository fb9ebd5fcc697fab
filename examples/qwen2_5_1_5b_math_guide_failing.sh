#!/usr/bin/env bash
# Guidance only where the student fails (configs/guide_failing.yaml; Guide-GRPO, BREAD):
# Qwen2.5-1.5B-Instruct draft, Qwen2.5-7B-Instruct guidance, math12k, 8 responses per prompt. The
# draft answers every prompt 8 times alone; a prompt whose 8 answers all fail gets 4 guided ones
# (λ 0.5, exact μ) in place of its first 4. PREFIX=1 adds teacher prefixes on those
# (configs/teacher_prefix.yaml: the guidance writes the first half, shortened to nothing over the
# run, the draft the rest).
# Hardware: one node, 8 x 80 GB GPUs (each holds an FSDP rank, a draft engine share and the guidance).
# Environment: MODEL_PATH, GUIDANCE_PATH, TRAIN_FILES, VAL_FILES, N_GPUS (per node), NNODES,
# PYTHON, GUIDANCE_GPUS (as in qwen2_5_1_5b_math_guided.sh), PREFIX (default 0). Extra arguments
# are key=value overrides (or --dry-run: check the config, models, data and reward without
# loading them, and print the final config).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/launcher_gpus.sh" 1  # checks N_GPUS, GUIDANCE_GPUS, NNODES; sets TRAIN_GPUS
OVERLAYS=(config="$ROOT/configs/guide_failing.yaml")
NAME=guide_failing
source "$ROOT/scripts/launcher_flags.sh"
if flag_on PREFIX "0 (default: no teacher prefix) or 1 (teacher prefixes, configs/teacher_prefix.yaml)"; then
    OVERLAYS+=(config="$ROOT/configs/teacher_prefix.yaml")
    NAME=teacher_prefix
fi
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" "${OVERLAYS[@]}" \
    worker.rollout.n=8 \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-1.5B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-7B-Instruct}" \
    data.train_files="${TRAIN_FILES:-hiyouga/math12k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/math12k@test}" \
    trainer.n_gpus_per_node="$TRAIN_GPUS" \
    worker.rollout.offpolicy_guidance.n_gpus_per_node="$GUIDANCE_GPUS" trainer.nnodes="$NNODES" \
    worker.rollout.n_gpus_per_node="$DRAFT_GPUS" \
    trainer.experiment_name="qwen2_5_1_5b_math_$NAME" "$@"
