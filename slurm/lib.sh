# slurm/lib.sh - what slurm/pretrain.sh and slurm/finetune.sh share: their common options, the
# self-submission, the job's environment, forwarding the stop signal to the trainer step, the
# wait for it and the requeue. Sourced by both (each sets PROG, its name in messages, first),
# outside a job from beside the script and inside one from beside the script that was
# submitted (Slurm runs a spooled copy: `scontrol show job` names the original). Defines
# functions and variables only.

EXIT_REQUEUE=85 # retromae_ds.components.signals.EXIT_REQUEUE

die() {
  echo "$PROG: $*" >&2
  exit 2
}

# slurm_seconds SPEC: a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds;
# prints nothing for UNLIMITED / infinite.
slurm_seconds() {
  local t=$1 d=0 h=0 m=0 s=0 a b c
  case "$t" in '' | UNLIMITED | unlimited | infinite | INFINITE) return 0 ;; esac
  if [[ $t == *-* ]]; then
    d=${t%%-*}
    IFS=: read -r h m s <<<"${t#*-}"
  else
    IFS=: read -r a b c <<<"$t"
    if [ -n "$c" ]; then h=$a m=$b s=$c; elif [ -n "$b" ]; then m=$a s=$b; else m=$a; fi
  fi
  echo $(((((10#$d * 24 + 10#${h:-0}) * 60) + 10#${m:-0}) * 60 + 10#${s:-0}))
}

# check_signal_lead TIME LEAD: refuse a time limit not longer than the warning lead, which
# would make Slurm send the stop signal at once and the job checkpoint and requeue in a loop.
check_signal_lead() {
  local limit
  limit=$(slurm_seconds "$1") || return 1
  if [ -n "$limit" ] && [ "$limit" -le "$2" ]; then
    echo "error: --time $1 ($limit s) is not longer than the stop-signal lead" \
      "(--signal-lead $2 s): the job would stop and requeue at once" >&2
    return 1
  fi
}

# ---- options -------------------------------------------------------------------------------
# The settings both scripts take, each also read from the environment variable of its name.
CONFIG=${CONFIG:-}
RUN_DIR=${RUN_DIR:-}
CPUS_PER_TASK=${CPUS_PER_TASK:-}
MAX_REQUEUES=${MAX_REQUEUES:-50}
NODES=${NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-0}
TASKS_PER_NODE=${TASKS_PER_NODE:-}
TIME=${TIME:-24:00:00}
SIGNAL_LEAD=${SIGNAL_LEAD:-300}
WAIT=""
TRAIN_ARGS=()

# value OPTION ARGS...: the option's value (its next word), or a one-line error without one.
value() {
  [ $# -ge 2 ] || die "$1 needs a value"
  VALUE=$2
}

# common_option ARGS...: read the option in $1 when it is one both scripts take, setting
# TAKEN to the words it used (0: not one of them).
common_option() {
  TAKEN=2
  case "$1" in
  --wait) WAIT=1 TAKEN=1 ;;
  --config) value "$@" && CONFIG=$VALUE ;;
  --run-dir) value "$@" && RUN_DIR=$VALUE ;;
  --cpus-per-task) value "$@" && CPUS_PER_TASK=$VALUE ;;
  --max-requeues) value "$@" && MAX_REQUEUES=$VALUE ;;
  --nodes) value "$@" && NODES=$VALUE ;;
  --gpus-per-node) value "$@" && GPUS_PER_NODE=$VALUE ;;
  --tasks-per-node) value "$@" && TASKS_PER_NODE=$VALUE ;;
  --time) value "$@" && TIME=$VALUE ;;
  --signal-lead) value "$@" && SIGNAL_LEAD=$VALUE ;;
  *) TAKEN=0 ;;
  esac
}

# parse_options OWN ARGS...: every option, the script's own through its function OWN (which
# sets TAKEN like common_option); the words after `--` are the trainer's (TRAIN_ARGS).
# Fills PASS_ARGS, the common options to hand the submitted copy.
parse_options() {
  local own=$1
  shift
  while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then
      shift
      TRAIN_ARGS=("$@")
      break
    fi
    TAKEN=0
    "$own" "$@"
    [ "$TAKEN" -gt 0 ] || common_option "$@"
    [ "$TAKEN" -gt 0 ] || die "unknown option $1 (trainer overrides go after --)"
    shift "$TAKEN"
  done
  [ -n "$RUN_DIR" ] || die "--run-dir (or RUN_DIR) is required"
  [ -z "$CONFIG" ] || [ -f "$CONFIG" ] || die "config file $CONFIG not found"
  PASS_ARGS=(--run-dir "$RUN_DIR" --max-requeues "$MAX_REQUEUES")
  [ -n "$CONFIG" ] && PASS_ARGS+=(--config "$CONFIG")
  [ -n "$CPUS_PER_TASK" ] && PASS_ARGS+=(--cpus-per-task "$CPUS_PER_TASK")
  return 0
}

# ---- outside a job -------------------------------------------------------------------------
# submit_self SCRIPT TASKS ARGS...: submit SCRIPT with the requested allocation (TASKS per node
# in CPU mode unless --tasks-per-node says), ARGS and the trainer's words; never returns.
submit_self() {
  local script=$1 tasks=$2
  shift 2
  check_signal_lead "$TIME" "$SIGNAL_LEAD" || exit 2
  if [ "$GPUS_PER_NODE" -gt 0 ]; then TASKS_PER_NODE=$GPUS_PER_NODE; fi
  mkdir -p "$RUN_DIR/logs"
  local sbatch_args=(
    --nodes="$NODES" --ntasks-per-node="${TASKS_PER_NODE:-$tasks}"
    --cpus-per-task="${CPUS_PER_TASK:-1}" --time="$TIME"
    --signal="B:USR1@$SIGNAL_LEAD" --requeue --open-mode=append
    --output="$RUN_DIR/logs/slurm-%j.out"
  )
  [ "$GPUS_PER_NODE" -gt 0 ] && sbatch_args+=(--gpus-per-node="$GPUS_PER_NODE")
  [ -n "$WAIT" ] && sbatch_args+=(--wait)
  exec sbatch "${sbatch_args[@]}" "$script" "$@" -- "${TRAIN_ARGS[@]}"
}

# ---- inside the job ------------------------------------------------------------------------
# job_environment: the run's log folder for this start (LOG_DIR), the hosts and tasks
# (HOSTS, NNODES, NTASKS, TASKS_PER_NODE), the rendezvous port, the CPU or GPU mode
# (GPU_ARGS for srun), and USR1 / TERM forwarded to the trainer step (TRAIN_PID, once set).
job_environment() {
  restart=${SLURM_RESTART_COUNT:-0}
  LOG_DIR="$RUN_DIR/logs/job$SLURM_JOB_ID.$restart"
  mkdir -p "$LOG_DIR"
  mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  NNODES=${#HOSTS[@]}
  NTASKS=${SLURM_NTASKS:-$NNODES}
  TASKS_PER_NODE=$((NTASKS / NNODES))
  # distinct for concurrent jobs, below the kernel's ephemeral range
  MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))
  CPUS_PER_TASK=${CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-1}}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$CPUS_PER_TASK}
  export TOKENIZERS_PARALLELISM=false
  GPU_ARGS=()
  if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
    GPU_ARGS=(--gpus-per-task=1)
  elif [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} # CPU mode: gloo, DeepSpeed's CPU accelerator
  fi
  TRAIN_PID=""
  trap 'forward_stop USR1' USR1
  trap 'forward_stop TERM' TERM
}

forward_stop() { # only forward: the trainer decides at its next step boundary
  echo "$PROG: $(date +%T) got SIG$1: asking the trainer to checkpoint and stop"
  [ -n "$TRAIN_PID" ] && kill -USR1 "$TRAIN_PID" 2>/dev/null
}

# wait_trainer: wait for the trainer step (TRAIN_PID) to end; its status in rc.
wait_trainer() {
  # a trapped signal interrupts `wait`; wait again until srun has really ended
  while kill -0 "$TRAIN_PID" 2>/dev/null; do wait "$TRAIN_PID"; done
  wait "$TRAIN_PID"
  rc=$?
  echo "$PROG: $(date +%T) trainer exited with $rc"
}

# requeue_on_checkpoint: on the trainer's EXIT_REQUEUE (a complete checkpoint after a stop
# signal) requeue the job, up to --max-requeues restarts; the job's status stays rc.
requeue_on_checkpoint() {
  [ "$rc" = "$EXIT_REQUEUE" ] || return 0
  if [ "$restart" -ge "$MAX_REQUEUES" ]; then
    echo "$PROG: checkpoint written, but $restart restarts reached --max-requeues: not requeueing"
    return 0
  fi
  # Slurm ends this script soon after a successful requeue; the status stays 85 either way
  if scontrol requeue "$SLURM_JOB_ID"; then
    echo "$PROG: checkpoint complete; job $SLURM_JOB_ID requeued (it resumes from there)"
  else
    echo "$PROG: scontrol requeue failed (was the job submitted with --no-requeue?)" >&2
  fi
}
