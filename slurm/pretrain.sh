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

EXIT_REQUEUE=85 # retromae_ds.components.signals.EXIT_REQUEUE

CONFIG=${CONFIG:-}
RUN_DIR=${RUN_DIR:-}
LAUNCHER=${LAUNCHER:-srun}
CPUS_PER_TASK=${CPUS_PER_TASK:-}
MAX_REQUEUES=${MAX_REQUEUES:-50}
NODES=${NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-0}
TASKS_PER_NODE=${TASKS_PER_NODE:-}
TIME=${TIME:-24:00:00}
SIGNAL_LEAD=${SIGNAL_LEAD:-300}
WAIT=""
TRAIN_ARGS=()

die() {
  echo "pretrain.sh: $*" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case "$1" in
  --config) CONFIG=$2; shift 2 ;;
  --run-dir) RUN_DIR=$2; shift 2 ;;
  --launcher) LAUNCHER=$2; shift 2 ;;
  --cpus-per-task) CPUS_PER_TASK=$2; shift 2 ;;
  --max-requeues) MAX_REQUEUES=$2; shift 2 ;;
  --nodes) NODES=$2; shift 2 ;;
  --gpus-per-node) GPUS_PER_NODE=$2; shift 2 ;;
  --tasks-per-node) TASKS_PER_NODE=$2; shift 2 ;;
  --time) TIME=$2; shift 2 ;;
  --signal-lead) SIGNAL_LEAD=$2; shift 2 ;;
  --wait) WAIT=1; shift ;;
  --) shift; TRAIN_ARGS=("$@"); break ;;
  *) die "unknown option $1 (trainer overrides go after --)" ;;
  esac
done
[ -n "$RUN_DIR" ] || die "--run-dir (or RUN_DIR) is required"
case "$LAUNCHER" in srun | deepspeed) ;; *) die "--launcher must be srun or deepspeed" ;; esac
[ -z "$CONFIG" ] || [ -f "$CONFIG" ] || die "config file $CONFIG not found"

pass_args=(--run-dir "$RUN_DIR" --launcher "$LAUNCHER" --max-requeues "$MAX_REQUEUES")
[ -n "$CONFIG" ] && pass_args+=(--config "$CONFIG")
[ -n "$CPUS_PER_TASK" ] && pass_args+=(--cpus-per-task "$CPUS_PER_TASK")

# ---- outside a job: submit this script with the requested allocation -----------------------
if [ -z "${SLURM_JOB_ID:-}" ]; then
  # shellcheck source=slurm/lib.sh
  . "$(dirname "$0")/lib.sh"
  check_signal_lead "$TIME" "$SIGNAL_LEAD" || exit 2
  if [ "$GPUS_PER_NODE" -gt 0 ]; then TASKS_PER_NODE=$GPUS_PER_NODE; fi
  mkdir -p "$RUN_DIR/logs"
  sbatch_args=(
    --nodes="$NODES" --ntasks-per-node="${TASKS_PER_NODE:-1}"
    --cpus-per-task="${CPUS_PER_TASK:-1}" --time="$TIME"
    --signal="B:USR1@$SIGNAL_LEAD" --requeue --open-mode=append
    --output="$RUN_DIR/logs/slurm-%j.out"
  )
  [ "$GPUS_PER_NODE" -gt 0 ] && sbatch_args+=(--gpus-per-node="$GPUS_PER_NODE")
  [ -n "$WAIT" ] && sbatch_args+=(--wait)
  exec sbatch "${sbatch_args[@]}" "$0" "${pass_args[@]}" -- "${TRAIN_ARGS[@]}"
fi

# ---- inside the job ----------------------------------------------------------------------------
SRUN_PID=""
on_signal() { # only forward: the trainer decides at its next step boundary
  echo "pretrain.sh: $(date +%T) got SIG$1: asking the trainer to checkpoint and stop"
  [ -n "$SRUN_PID" ] && kill -USR1 "$SRUN_PID" 2>/dev/null
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

restart=${SLURM_RESTART_COUNT:-0}
LOG_DIR="$RUN_DIR/logs/job$SLURM_JOB_ID.$restart"
mkdir -p "$LOG_DIR"
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
CPUS_PER_TASK=${CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-1}}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$CPUS_PER_TASK}
export TOKENIZERS_PARALLELISM=false
if [ -z "${SLURM_GPUS_ON_NODE:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} # CPU mode: gloo, DeepSpeed's CPU accelerator
fi
NNODES=$SLURM_JOB_NUM_NODES
NTASKS=${SLURM_NTASKS:-$NNODES}
TASKS_PER_NODE=$((NTASKS / NNODES))
trainer=(--run_dir "$RUN_DIR" --checkpoint.resume auto)
[ -n "$CONFIG" ] && trainer=(--config "$CONFIG" "${trainer[@]}")
trainer+=("${TRAIN_ARGS[@]}")
echo "pretrain.sh: $(date +%T) job $SLURM_JOB_ID restart $restart: $NNODES node(s) x" \
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
  scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$TASKS_PER_NODE/" >"$HOSTFILE"
  srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
    --cpus-per-task=$((CPUS_PER_TASK * TASKS_PER_NODE)) \
    --kill-on-bad-exit=1 --wait=120 --output="$LOG_DIR/node_%n.log" \
    bash -c 'trap "" USR1; exec "${DEEPSPEED:-deepspeed}" --hostfile "$0" --no_ssh \
      --node_rank "$SLURM_NODEID" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
      --enable_each_rank_log "$1" --module retromae_ds.pretrain "${@:2}"' \
    "$HOSTFILE" "$LOG_DIR" "${trainer[@]}" &
fi
SRUN_PID=$!
# a trapped signal interrupts `wait`; wait again until srun has really ended
while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID"; done
wait "$SRUN_PID"
rc=$?
echo "pretrain.sh: $(date +%T) trainer exited with $rc"

if [ "$rc" = "$EXIT_REQUEUE" ]; then
  if [ "$restart" -ge "$MAX_REQUEUES" ]; then
    echo "pretrain.sh: checkpoint written, but $restart restarts reached --max-requeues: not requeueing"
    exit "$rc"
  fi
  # Slurm ends this script soon after a successful requeue; the status stays 85 either way
  if scontrol requeue "$SLURM_JOB_ID"; then
    echo "pretrain.sh: checkpoint complete; job $SLURM_JOB_ID requeued (it resumes from there)"
  else
    echo "pretrain.sh: scontrol requeue failed (was the job submitted with --no-requeue?)" >&2
  fi
fi
exit "$rc"
