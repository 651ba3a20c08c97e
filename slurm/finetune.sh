#!/bin/bash
# slurm/finetune.sh - ANCE fine-tuning on Slurm: the trainer and the hard-negative refresher
# as two concurrent job steps of one allocation, with a configurable split of nodes / tasks
# (one task per GPU, or per CPU slot in CPU mode). See docs/ance.md.
#
# Submit it yourself:
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8 --time=24:00:00 \
#       --output=runs/ft/slurm-%j.out slurm/finetune.sh --config ft.yaml --run-dir runs/ft \
#       --refresher-tasks 2
# or let it submit itself:
#   slurm/finetune.sh --nodes 2 --gpus-per-node 8 --refresher-nodes 1 --config ft.yaml --run-dir runs/ft
#
# Split (each also read from the environment variable in brackets):
#   --refresher-nodes R   the last R nodes run the refresher, the others the trainer
#                         (REFRESHER_NODES, default 0: both share every node)
#   --refresher-tasks T   with R = 0: T of the allocation's tasks (GPUs) go to the refresher,
#                         the rest to the trainer (REFRESHER_TASKS, default 1); with R > 0 the
#                         refresher gets every task of its R nodes; T = 0 (and R = 0): no
#                         refresher step, the trainer gets every task and runs with
#                         --refresher none (a cross-encoder, or training on the first
#                         negatives alone)
# Other options:
#   --config FILE         fine-tuning config, YAML/JSON (CONFIG); its `refresh` section
#                         configures the refresher (the trainer writes RUN/refresh_config.json,
#                         which the refresher step waits for)
#   --run-dir DIR         run folder (RUN_DIR; required)
#   --cpus-per-task C     CPUs per task (CPUS_PER_TASK; default the job's, else 1)
#   --max-requeues K      (MAX_REQUEUES, default 50)
#   submission only: --nodes N, --gpus-per-node G (0 = CPU mode), --tasks-per-node T,
#   --time T, --signal-lead S, --wait (as slurm/pretrain.sh)
#   -- ARGS...            passed to the trainer (--section.field value overrides)
#
# Steps: both are `srun --exact` steps (each holds only its own tasks' CPUs and GPUs). The
# refresher has its own rendezvous (its first node, MASTER_PORT + 1). When the trainer step
# ends, the refresher gets a minute to notice RUN/FINISHED, then its step is ended; a refresher
# killed at any point leaves no visible partial negatives version. If the refresher dies, the
# trainer goes on with the last published negatives.
# Stop and requeue as in slurm/pretrain.sh: USR1 (time-limit warning, preemption) goes to the
# trainer, which checkpoints and exits 85; this script requeues the job, and the requeued job
# resumes both steps (trainer from its checkpoint, refresher at the next version).
#
#SBATCH --job-name=retromae-finetune
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
set -uo pipefail
PROG=finetune.sh
# Inside a job Slurm runs a spooled copy of this script: lib.sh lies beside the submitted one.
LIB=$(dirname "$0")/lib.sh
if [ -n "${SLURM_JOB_ID:-}" ] && [ ! -f "$LIB" ]; then
  LIB=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
  [[ $LIB == /* ]] || LIB=$SLURM_SUBMIT_DIR/$LIB
  LIB=$(dirname "$LIB")/lib.sh
fi
# shellcheck source=slurm/lib.sh
. "$LIB"
REFRESHER_NODES=${REFRESHER_NODES:-0}
REFRESHER_TASKS=${REFRESHER_TASKS:-1}

own_option() {
  case "$1" in
  --refresher-nodes) value "$@" && REFRESHER_NODES=$VALUE TAKEN=2 ;;
  --refresher-tasks) value "$@" && REFRESHER_TASKS=$VALUE TAKEN=2 ;;
  esac
}
parse_options own_option "$@"

# ---- outside a job: submit this script with the requested allocation -----------------------
[ -n "${SLURM_JOB_ID:-}" ] || submit_self "$0" 2 "${PASS_ARGS[@]}" \
  --refresher-nodes "$REFRESHER_NODES" --refresher-tasks "$REFRESHER_TASKS"

# ---- inside the job ----------------------------------------------------------------------------
job_environment
if [ "$REFRESHER_NODES" -gt 0 ]; then
  [ "$REFRESHER_NODES" -lt "$NNODES" ] || die "--refresher-nodes $REFRESHER_NODES leaves no node for the trainer"
  TRAIN_HOSTS=("${HOSTS[@]:0:NNODES-REFRESHER_NODES}")
  REFRESH_HOSTS=("${HOSTS[@]:NNODES-REFRESHER_NODES}")
  TRAIN_TASKS=$((${#TRAIN_HOSTS[@]} * TASKS_PER_NODE))
  REFRESH_TASKS=$((REFRESHER_NODES * TASKS_PER_NODE))
else
  TRAIN_HOSTS=("${HOSTS[@]}")
  REFRESH_HOSTS=("${HOSTS[@]}")
  [ "$REFRESHER_TASKS" -ge 0 ] && [ "$REFRESHER_TASKS" -lt "$NTASKS" ] \
    || die "--refresher-tasks $REFRESHER_TASKS: from 0 (no refresher step) to $((NTASKS - 1)) (one task left for the trainer)"
  TRAIN_TASKS=$((NTASKS - REFRESHER_TASKS))
  REFRESH_TASKS=$REFRESHER_TASKS
fi
join() { local IFS=,; echo "$*"; }
# the refresher is this job's other step (what --negatives.mine_first waits for), unless
# --refresher-tasks 0 asks for none
REFRESHER=external
[ "$REFRESH_TASKS" -gt 0 ] || REFRESHER=none
trainer=(--run_dir "$RUN_DIR" --checkpoint.resume auto --refresher "$REFRESHER")
[ -n "$CONFIG" ] && trainer=(--config "$CONFIG" "${trainer[@]}")
trainer+=("${TRAIN_ARGS[@]}")
echo "$PROG: $(date +%T) job $SLURM_JOB_ID restart $restart: trainer $TRAIN_TASKS task(s) on" \
  "$(join "${TRAIN_HOSTS[@]}"), refresher $REFRESH_TASKS task(s) on $(join "${REFRESH_HOSTS[@]}"), logs $LOG_DIR"

# a previous job's marker must not stop this job's refresher before the trainer removes it
rm -f "$RUN_DIR/FINISHED"

# the trainer: one task per rank
MASTER_ADDR=${TRAIN_HOSTS[0]} MASTER_PORT=$MASTER_PORT \
  srun --exact --nodes="${#TRAIN_HOSTS[@]}" --nodelist="$(join "${TRAIN_HOSTS[@]}")" \
  --ntasks="$TRAIN_TASKS" --cpus-per-task="$CPUS_PER_TASK" "${GPU_ARGS[@]}" \
  --kill-on-bad-exit=1 --wait=120 --output="$LOG_DIR/trainer_%t.log" \
  bash -c 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
    exec "$0" "$@"' "${PYTHON:-python}" -m retromae_ds.finetune "${trainer[@]}" &
TRAIN_PID=$!

# the refresher: waits for the trainer's refresh_config.json (its `refresh` section); USR1
# is not for it (it holds no state worth a checkpoint)
REFRESH_PID=
if [ "$REFRESH_TASKS" -gt 0 ]; then
  MASTER_ADDR=${REFRESH_HOSTS[0]} MASTER_PORT=$((MASTER_PORT + 1)) \
    srun --exact --nodes="${#REFRESH_HOSTS[@]}" --nodelist="$(join "${REFRESH_HOSTS[@]}")" \
    --ntasks="$REFRESH_TASKS" --cpus-per-task="$CPUS_PER_TASK" "${GPU_ARGS[@]}" \
    --kill-on-bad-exit=1 --wait=120 --output="$LOG_DIR/refresher_%t.log" \
    bash -c 'trap "" USR1; export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
      while [ ! -f "$1/refresh_config.json" ]; do sleep 5; done
      exec "$0" -m retromae_ds.refresh --config "$1/refresh_config.json"' \
    "${PYTHON:-python}" "$RUN_DIR" &
  REFRESH_PID=$!
fi

wait_trainer
if [ -n "$REFRESH_PID" ]; then
  for _ in $(seq 60); do kill -0 "$REFRESH_PID" 2>/dev/null || break; sleep 1; done
  if kill -0 "$REFRESH_PID" 2>/dev/null; then
    echo "$PROG: ending the refresher step"
    kill -TERM "$REFRESH_PID" 2>/dev/null
    wait "$REFRESH_PID"
  fi
fi

requeue_on_checkpoint
exit "$rc"
