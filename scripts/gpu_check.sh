#!/usr/bin/env bash
# The project's GPU check: one command on a CUDA machine, under 9 minutes on one H200 (every
# step has its own time limit; their sum is 530 s, so a 10-minute device call always returns).
#   1. the `gpu`-marked tests (every attention backend against the reference on CUDA, fp32 and
#      bf16, outputs and gradients; the decoders' losses on FlexAttention vs reference),
#   2. benchmarks/bench_long.py on CUDA (a BERT-base-sized RetroMAE step at 512 and 8,192
#      tokens: peak memory and tokens/s; the plain vocabulary head at 8,192 as the baseline),
#   3. benchmarks/bench_attention.py on CUDA, bf16 (time and peak memory vs reference,
#      L = 2048, 8192; fp32 correctness is in step 1; ATTN_DTYPES="bfloat16 float32" for both),
#   4. benchmarks/bench_train.py on CUDA (tokens/s, DeepSpeed vs plain torch, flex vs
#      reference decoder attention, encoder MFU against the H200's 989 TFLOP/s dense bf16).
# Results (text + JSON) go to the folder given as $1 (default: $OUT if set, else gpu_results/),
# each file written as its step runs, so a cut-off run still returns what finished.
# Without a CUDA GPU it says so and exits 0. Exit status: non-zero if the tests fail.
# Offline: uses the python3 that holds torch (PYTHON=... to choose) and this checkout on
# PYTHONPATH; without DeepSpeed installed the training benchmark times the plain loop only.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-gpu_results}}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU visible to torch ($PY); nothing to run, skipped" \
        | tee "$RESULTS/summary.txt"
    exit 0
fi

start=$SECONDS
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
    "$PY" -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' 2>/dev/null \
        || echo "deepspeed: not installed (training benchmark: plain torch loop only)"
} 2>&1 | tee "$RESULTS/device.txt"

echo "== gpu tests"
timeout 160 "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" \
    tests/test_attention.py tests/test_model.py tests/test_seed_encoder.py \
    2>&1 | tee "$RESULTS/gpu_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== long-input benchmark (BERT-base sized, bf16: peak memory and tokens/s, L = 512 vs 8192)"
timeout 130 "$PY" benchmarks/bench_long.py --device cuda --dtype bf16 --size base \
    --lengths 512 8192 --objectives retromae --baselines plain-head --baseline-lengths 8192 \
    --tokens 32768 --steps 3 --timeout 60 \
    --json "$RESULTS/long_bf16.json" 2>&1 | tee "$RESULTS/long_bf16.txt"

echo "== attention benchmark"
for dtype in ${ATTN_DTYPES:-bfloat16}; do
    timeout 150 "$PY" benchmarks/bench_attention.py --device cuda --dtype "$dtype" \
        --lengths 2048 8192 --batch 8 --heads 12 --dim 64 --repeats 5 --rounds 1 \
        --timeout 60 --json "$RESULTS/attention_$dtype.json" 2>&1 | tee "$RESULTS/attention_$dtype.txt"
done

echo "== training benchmark"
ds_flag=""
"$PY" -c 'import deepspeed' 2>/dev/null || ds_flag="--no-deepspeed"
timeout 90 "$PY" benchmarks/bench_train.py --device cuda --dtype bf16 --sizes small base \
    --length 512 --batch 32 --steps 10 --repeats 1 --peak-tflops 989 $ds_flag \
    --json "$RESULTS/train_bf16.json" 2>&1 | tee "$RESULTS/train_bf16.txt"

{
    echo "gpu_check finished in $((SECONDS - start)) s, tests $([ $status -eq 0 ] && echo passed || echo FAILED)"
    grep -h "^|" "$RESULTS"/attention_*.txt "$RESULTS"/train_bf16.txt "$RESULTS"/long_bf16.txt 2>/dev/null
} | tee "$RESULTS/summary.txt"
exit $status
