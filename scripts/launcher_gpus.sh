# Sourced by the GPU launchers whose guidance may have GPUs of its own (examples/
# qwen2_5_1_5b_math_guided.sh, _guided_multinode.sh, _mentor.sh, ...): checks N_GPUS,
# GUIDANCE_GPUS, DRAFT_GPUS and NNODES before python starts (a bad one: one line naming it, exit
# 2), sets TRAIN_GPUS = N_GPUS - GUIDANCE_GPUS - DRAFT_GPUS (the FSDP ranks per node, and the
# draft engines with them unless DRAFT_GPUS gives them GPUs of their own), and exports
# VERL_LAUNCHER_KEYS so that the trainer's error on a key set from them names them too
# (verl/trainer/main.py, launcher_hint). Usage: source scripts/launcher_gpus.sh DEFAULT_NNODES
N_GPUS=${N_GPUS:-8}
GUIDANCE_GPUS=${GUIDANCE_GPUS:-0}
DRAFT_GPUS=${DRAFT_GPUS:-0}
NNODES=${NNODES:-${1:-1}}
for var in N_GPUS NNODES; do
    if ! [[ ${!var} =~ ^[1-9][0-9]*$ ]]; then
        echo "error: $var=${!var} is not valid; expected a whole number >= 1" >&2
        exit 2
    fi
done
if ! [[ $GUIDANCE_GPUS =~ ^[0-9]+$ ]] || ((GUIDANCE_GPUS >= N_GPUS)); then
    echo "error: GUIDANCE_GPUS=$GUIDANCE_GPUS is not valid with N_GPUS=$N_GPUS; expected 0 (the" \
        "guidance shares every GPU) to $((N_GPUS - 1)) (GPUs per node of its own: the FSDP ranks" \
        "and draft engines take the other N_GPUS - GUIDANCE_GPUS)" >&2
    exit 2
fi
if ! [[ $DRAFT_GPUS =~ ^[0-9]+$ ]] || ((GUIDANCE_GPUS + DRAFT_GPUS >= N_GPUS)); then
    echo "error: DRAFT_GPUS=$DRAFT_GPUS is not valid with N_GPUS=$N_GPUS and GUIDANCE_GPUS=$GUIDANCE_GPUS;" \
        "expected 0 (the draft engines share the FSDP ranks' GPUs) to $((N_GPUS - GUIDANCE_GPUS - 1))" \
        "(GPUs per node of their own: the FSDP ranks take the other N_GPUS - GUIDANCE_GPUS - DRAFT_GPUS)" >&2
    exit 2
fi
TRAIN_GPUS=$((N_GPUS - GUIDANCE_GPUS - DRAFT_GPUS))
export VERL_LAUNCHER_KEYS="trainer.n_gpus_per_node=N_GPUS - GUIDANCE_GPUS - DRAFT_GPUS = $N_GPUS - $GUIDANCE_GPUS - $DRAFT_GPUS"
VERL_LAUNCHER_KEYS+=";worker.rollout.offpolicy_guidance.n_gpus_per_node=GUIDANCE_GPUS = $GUIDANCE_GPUS"
VERL_LAUNCHER_KEYS+=";worker.rollout.n_gpus_per_node=DRAFT_GPUS = $DRAFT_GPUS"
VERL_LAUNCHER_KEYS+=";trainer.nnodes=NNODES = $NNODES"
