#!/usr/bin/env bash
# Asynchronous guided GRPO (configs/async.yaml, staleness 1): the draft engines and the guidance
# generate step s + 1 while the actor trains step s; the decoupled loss corrects the one-version-old
# samples with π_old/μ. Qwen2.5-1.5B-Instruct draft, Qwen2.5-7B-Instruct guidance, math12k.
# Hardware: one node, 8 x 80 GB GPUs. By default the draft engines share the actor's GPUs and keep
# their memory while it trains (free_cache_engine off); GUIDANCE_GPUS=2 gives the guidance 2 GPUs
# of its own and DRAFT_GPUS=2 the draft engines 2 of theirs (one replica each), so that both
# generate beside the training on GPUs the actor does not use (then 4 ranks). Environment:
# MODEL_PATH, GUIDANCE_PATH, TRAIN_FILES, VAL_FILES, N_GPUS (per node), NNODES, PYTHON,
# GUIDANCE_GPUS, DRAFT_GPUS, STALENESS (default 1). Extra arguments are key=value overrides (or
# --dry-run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/launcher_gpus.sh" 1  # checks N_GPUS, GUIDANCE_GPUS, NNODES; sets TRAIN_GPUS
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" config="$ROOT/configs/guidance_speculative.yaml" \
    config="$ROOT/configs/async.yaml" async_training.staleness="${STALENESS:-1}" \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-1.5B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-7B-Instruct}" \
    data.train_files="${TRAIN_FILES:-hiyouga/math12k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/math12k@test}" \
    trainer.n_gpus_per_node="$TRAIN_GPUS" \
    worker.rollout.offpolicy_guidance.n_gpus_per_node="$GUIDANCE_GPUS" trainer.nnodes="$NNODES" \
    worker.rollout.n_gpus_per_node="$DRAFT_GPUS" \
    trainer.experiment_name=qwen2_5_1_5b_math_guided_async "$@"
