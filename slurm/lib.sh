# Helpers for the submitting side of slurm/*.sh (sourced outside a job only: inside a job
# Slurm runs a spooled copy of the script, away from this file).

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
