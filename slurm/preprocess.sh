#!/bin/bash
# slurm/preprocess.sh - preprocessing on Slurm: an array job of T independent tasks, each
# writing its disjoint share of the shards (retromae-ds preprocess --num_tasks T --task_index
# I), then the merge step (--merge: the one manifest) as a job that depends on the whole array
# (afterok; cancelled if a task fails). The result is identical to one local run.
#
#   slurm/preprocess.sh --tasks 16 --out shards/wiki --cpus-per-task 4 --time 2:00:00 -- \
#       'texts/*.jsonl' --tokenizer path/to/tokenizer --max_length 512
#
# Options (environment variable in brackets):
#   --tasks T           array size (TASKS, default 4)
#   --out DIR           output folder (OUT; required); logs go to DIR/logs/
#   --cpus-per-task C   CPUs (= preprocessing workers) per task (CPUS_PER_TASK, default 1)
#   --time T            time limit of each job (TIME, default 4:00:00)
#   --wait              return when the merge job has ended, with its exit status
#   -- ARGS...          inputs and options of `retromae-ds preprocess` (a tokenizer folder:
#                       --train_tokenizer needs one process; train it first)
# Prints "array JOBID merge JOBID". Partition/account: SBATCH_PARTITION, SBATCH_ACCOUNT.
#SBATCH --job-name=retromae-preprocess
#SBATCH --open-mode=append
set -uo pipefail

TASKS=${TASKS:-4}
OUT=${OUT:-}
CPUS_PER_TASK=${CPUS_PER_TASK:-1}
TIME=${TIME:-4:00:00}
MODE=submit
WAIT=""
ARGS=()
die() {
  echo "preprocess.sh: $*" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case "$1" in
  --tasks) TASKS=$2; shift 2 ;;
  --out) OUT=$2; shift 2 ;;
  --cpus-per-task) CPUS_PER_TASK=$2; shift 2 ;;
  --time) TIME=$2; shift 2 ;;
  --wait) WAIT=1; shift ;;
  --mode) MODE=$2; shift 2 ;; # task | merge: set by the submission, not by hand
  --) shift; ARGS=("$@"); break ;;
  *) die "unknown option $1 (preprocess arguments go after --)" ;;
  esac
done
[ -n "$OUT" ] || die "--out (or OUT) is required"
PY=${PYTHON:-python}

case "$MODE" in
submit)
  [ -z "${SLURM_JOB_ID:-}" ] || die "run it outside a job: it submits the array and the merge job"
  [ "${#ARGS[@]}" -gt 0 ] || die "no inputs: give them after --"
  mkdir -p "$OUT/logs"
  common=(--parsable --time="$TIME" --open-mode=append)
  array=$(sbatch "${common[@]}" --array="0-$((TASKS - 1))" --cpus-per-task="$CPUS_PER_TASK" \
    --output="$OUT/logs/preprocess-%A_%a.out" \
    "$0" --mode task --tasks "$TASKS" --out "$OUT" -- "${ARGS[@]}") || die "sbatch (array) failed"
  array=${array%%;*}
  merge_args=("${common[@]}" --dependency="afterok:$array" --kill-on-invalid-dep=yes
    --job-name=retromae-preprocess-merge --output="$OUT/logs/merge-%j.out")
  if [ -n "$WAIT" ]; then
    # sbatch --wait prints the id first, then returns the merge job's status
    sbatch "${merge_args[@]}" --wait "$0" --mode merge --out "$OUT" |
      { read -r merge && echo "array $array merge ${merge%%;*}"; cat; }
    exit "${PIPESTATUS[0]}"
  fi
  merge=$(sbatch "${merge_args[@]}" "$0" --mode merge --out "$OUT") || die "sbatch (merge) failed"
  echo "array $array merge ${merge%%;*}"
  ;;
task)
  [ "${SLURM_ARRAY_TASK_COUNT:-$TASKS}" = "$TASKS" ] ||
    die "array of $SLURM_ARRAY_TASK_COUNT tasks but --tasks $TASKS"
  index=$((SLURM_ARRAY_TASK_ID - ${SLURM_ARRAY_TASK_MIN:-0}))
  echo "preprocess.sh: $(date +%T) task $index of $TASKS on $(hostname)"
  exec "$PY" -m retromae_ds.cli preprocess "${ARGS[@]}" --out "$OUT" --num_tasks "$TASKS" \
    --task_index "$index" --workers "${SLURM_CPUS_PER_TASK:-$CPUS_PER_TASK}" --progress false
  ;;
merge)
  echo "preprocess.sh: $(date +%T) merging the tasks' shards on $(hostname)"
  exec "$PY" -m retromae_ds.cli preprocess --out "$OUT" --merge --progress false
  ;;
*) die "--mode must be task or merge" ;;
esac
