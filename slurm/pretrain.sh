#!/bin/bash
# slurm/pretrain.sh - pre-training on Slurm: N nodes x G tasks (one task per GPU, or per CPU
# slot in CPU mode), launched with srun (default) or the deepspeed launcher; stops on the
# time-limit warning with a complete checkpoint and requeues itself. See docs/slurm.md.
#
# Submit it yourself (the allocation comes from sbatch's options):
#   sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8 --time=24:00:00 \
#       --output=runs/wiki/slurm-%j.out slurm/pretrain.sh --config my.yaml --run-dir runs/wiki
# or let it submit itself (outside a job it builds the sbatch command from its options):
#   slurm/pretrain.sh --nodes 2 --gpus-per-node 4 --time 24:00:00 --config my.yaml --run-dir runs/wiki
#
# Options (each also read from the environment variable in brackets):
#   --config FILE         training config, YAML/JSON (CONFIG)
#   --run-dir DIR         run folder: checkpoints, metrics, logs/ (RUN_DIR; required)
#   --launcher L          srun | deepspeed (LAUNCHER, default srun)
#   --cpus-per-task C     CPUs per rank, passed to srun explicitly (CPUS_PER_TASK; default
#                         the job's SLURM_CPUS_PER_TASK, else 1)
#   --max-requeues K      stop requeueing after K restarts (MAX_REQUEUES, default 50)
#   submission only (outside a job):
#   --nodes N             (NODES, default 1)
#   --gpus-per-node G     one task per GPU; 0 = CPU mode (GPUS_PER_NODE, default 0)
#   --tasks-per-node T    tasks per node in CPU mode (TASKS_PER_NODE, default 1)
#   --time T              time limit (TIME, default 24:00:00)
#   --signal-lead S       seconds before the limit to warn the trainer (SIGNAL_LEAD, 300)
#   --wait                sbatch --wait: return the job's exit status
#   -- ARGS...            passed to the trainer (--section.field value overrides)
# Partition, account, QOS: sbatch's own SBATCH_PARTITION, SBATCH_ACCOUNT, ... variables.
#
# Ranks: MASTER_ADDR is the allocation's first host, MASTER_PORT = 10000 + jobid % 20000
# (distinct for concurrent jobs, below the kernel's ephemeral range); the srun launcher maps
# SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID to RANK / WORLD_SIZE / LOCAL_RANK.
#
# Stop and requeue protocol: Slurm sends USR1 to this batch shell (--signal=B:USR1@lead, or
# `scancel --signal=USR1 --batch JOBID`); the shell forwards USR1 to srun, which delivers it
# to every process of the step. The trainer finishes the current step on all ranks, writes a
# complete checkpoint and exits 85 (retromae_ds.components.signals.EXIT_REQUEUE); on 85 this script runs
# `scontrol requeue`, and the requeued job resumes from the checkpoint (--checkpoint.resume auto).
# Any other non-zero status fails the job: srun --kill-on-bad-exit=1 ends every rank when one
# dies, and --deepspeed.timeout_s bounds a collective waiting for a dead peer.
#
#SBATCH --job-name=retromae-pretrain
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
set -uo pipefail
PROG=pretrain.sh
# Inside a job Slurm runs a spooled copy of this script: lib.sh lies beside the submitted one.
LIB=$(dirname "$0")/lib.sh
if [ -n "${SLURM_JOB_ID:-}" ] && [ ! -f "$LIB" ]; then
  LIB=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
  [[ $LIB == /* ]] || LIB=$SLURM_SUBMIT_DIR/$LIB
  LIB=$(dirname "$LIB")/lib.sh
fi
# shellcheck source=slurm/lib.sh
. "$LIB"
LAUNCHER=${LAUNCHER:-srun}

own_option() {
  if [ "$1" = --launcher ]; then value "$@" && LAUNCHER=$VALUE TAKEN=2; fi
}
parse_options own_option "$@"
case "$LAUNCHER" in srun | deepspeed) ;; *) die "--launcher must be srun or deepspeed" ;; esac

# ---- outside a job: submit this script with the requested allocation -----------------------
[ -n "${SLURM_JOB_ID:-}" ] || submit_self "$0" 1 "${PASS_ARGS[@]}" --launcher "$LAUNCHER"

# ---- inside the job ----------------------------------------------------------------------------
job_environment
MASTER_ADDR=${HOSTS[0]}
export MASTER_ADDR MASTER_PORT
trainer=(--run_dir "$RUN_DIR" --checkpoint.resume auto)
[ -n "$CONFIG" ] && trainer=(--config "$CONFIG" "${trainer[@]}")
trainer+=("${TRAIN_ARGS[@]}")
echo "$PROG: $(date +%T) job $SLURM_JOB_ID restart $restart: $NNODES node(s) x" \
  "$TASKS_PER_NODE task(s), launcher $LAUNCHER, master $MASTER_ADDR:$MASTER_PORT, logs $LOG_DIR"

if [ "$LAUNCHER" = srun ]; then
  # one task per rank; the rank variables are read inside each task
  srun --nodes="$NNODES" --ntasks="$NTASKS" --cpus-per-task="$CPUS_PER_TASK" \
    --kill-on-bad-exit=1 --wait=120 --output="$LOG_DIR/rank_%t.log" \
    bash -c 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
      exec "$0" "$@"' "${PYTHON:-python}" -m retromae_ds.pretrain "${trainer[@]}" &
else
  # one deepspeed launcher per node (no ssh: --no_ssh with this node's rank); it starts the
  # node's ranks. The launchers ignore USR1, which srun delivers to every process of the step.
  HOSTFILE="$LOG_DIR/hostfile"
  printf '%s slots='"$TASKS_PER_NODE"'\n' "${HOSTS[@]}" >"$HOSTFILE"
  srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
    --cpus-per-task=$((CPUS_PER_TASK * TASKS_PER_NODE)) \
    --kill-on-bad-exit=1 --wait=120 --output="$LOG_DIR/node_%n.log" \
    bash -c 'trap "" USR1; exec "${DEEPSPEED:-deepspeed}" --hostfile "$0" --no_ssh \
      --node_rank "$SLURM_NODEID" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
      --enable_each_rank_log "$1" --module retromae_ds.pretrain "${@:2}"' \
    "$HOSTFILE" "$LOG_DIR" "${trainer[@]}" &
fi
TRAIN_PID=$!
wait_trainer
requeue_on_checkpoint
exit "$rc"
