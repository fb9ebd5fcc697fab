#!/usr/bin/env bash
# Guided GRPO with tool use (multi-turn): Qwen2.5-1.5B-Instruct draft, Qwen2.5-7B-Instruct guidance,
# math12k, the built-in `calculator` tool in Qwen's hermes format (<tool_call>{json}</tool_call>).
# Each prompt gets the tool instructions as a system message; a turn ends at <|im_end|>, all its
# calls run, their results are appended in call order as tool-turn tokens of Qwen's chat template
# (response_mask 0),
# and every policy turn is guided token by token (speculative mode, exact behavior log-probs).
# Never run on a GPU by us (no machine of ours has vLLM on one): run `make gpu-check` first.
# Hardware: one node, 8 x 80 GB GPUs. Environment: MODEL_PATH, GUIDANCE_PATH, TRAIN_FILES,
# VAL_FILES, N_GPUS (per node), NNODES, PYTHON, GUIDANCE_GPUS (as qwen2_5_1_5b_math_guided.sh).
# Extra arguments are key=value overrides (or --dry-run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/launcher_gpus.sh" 1  # checks N_GPUS, GUIDANCE_GPUS, NNODES; sets TRAIN_GPUS
${PYTHON:-python3} -m verl.trainer.main \
    config="$ROOT/examples/qwen2_5_math.yaml" config="$ROOT/configs/guidance_speculative.yaml" \
    worker.actor.model.model_path="${MODEL_PATH:-Qwen/Qwen2.5-1.5B-Instruct}" \
    worker.rollout.offpolicy_guidance.model_path="${GUIDANCE_PATH:-Qwen/Qwen2.5-7B-Instruct}" \
    data.train_files="${TRAIN_FILES:-hiyouga/math12k@train}" \
    data.val_files="${VAL_FILES:-hiyouga/math12k@test}" \
    worker.rollout.multi_turn.enable=true worker.rollout.multi_turn.tools=[calculator] \
    worker.rollout.multi_turn.tool_call_format=hermes worker.rollout.multi_turn.max_turns=4 \
    worker.rollout.multi_turn.max_tool_response_length=256 \
    trainer.n_gpus_per_node="$TRAIN_GPUS" \
    worker.rollout.offpolicy_guidance.n_gpus_per_node="$GUIDANCE_GPUS" trainer.nnodes="$NNODES" \
    worker.rollout.n_gpus_per_node="$DRAFT_GPUS" \
    trainer.experiment_name=qwen2_5_1_5b_tools_guided "$@"
