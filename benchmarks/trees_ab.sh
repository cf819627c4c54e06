#!/usr/bin/env bash
# Question: is the working tree's attention as fast as an older tree's? (the attention targets
# preset, old then new, back to back in one device call; believe it after tests/torch_attention_test.py)
#   locally:  mkdir -p .ab/old && git archive REV sparsetp | tar -x -C .ab/old   (.ab/ is git-ignored
#             via .git/info/exclude), then run with the device tool, carry [".whl", ".ab"]:
#   OUT=$OUT bash benchmarks/trees_ab.sh [.ab/old]
set -u
OLD=${1:-.ab/old}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for side in old new; do
  dir=$ROOT; [ "$side" = old ] && dir=$OLD
  (cd "$dir" && timeout -k 5 "${AB_S:-230}" python3 -m sparsetp.bench attention --preset=targets \
    --out_dir="$OUT/$side" --json_name=attention.json --noplots --budget_s="${AB_BUDGET:-150}" \
    > "$OUT/$side.log" 2>&1; echo "$side rc=$?")
done
python3 "$ROOT/benchmarks/trees_ab_compare.py" "$OUT/old/attention.json" "$OUT/new/attention.json" \
  | tee "$OUT/compare.txt"
