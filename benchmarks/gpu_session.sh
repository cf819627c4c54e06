#!/usr/bin/env bash
# One batched device-tool call (tp and parity at TP=2 need 2 GPUs): the compiled kernels'
# correctness check, the attention targets benchmark, the TP benchmark and the GPU parity run,
# each under its own wall-clock limit so a failing or slow stage cannot starve the next. Logs and
# JSON land in $OUT (one log and one JSON per stage). Run from the repo root with carry
# [".whl", ".gpu_deps"] (jax_triton and any other wheels the GPU image lacks).
#   usage: bash benchmarks/gpu_session.sh [stage ...]   (default: check attn tp parity)
#   stages: check (benchmarks/gpu_correctness.py; CHECK_ARGS adds flags) attn tp
#   parity (PARITY_TP, default 1,2) parity16 (bf16/fp16 attention only; head dims PARITY16_D,
#   default 128)
#   ab (benchmarks/launch_ab.py; AB_ARGS, default the tile preset)
#   probe (JAX MLP fwd+bwd variants on one GPU, issue #9)
#   demo (the main job on 2 GPUs, torch and JAX, bf16)
#   scaling (benchmarks/gpt_scaling.py: GPT training TP=1 / DP=2 / TP=2, torch and JAX, issue #24)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  || echo "jax_triton wheel install failed"
export PYTHONPATH=/tmp/site:$PWD/.gpu_deps:$PWD:${PYTHONPATH:-}
T0=$(date +%s)
stage() {  # name limit_s command...
  local name=$1 lim=$2; shift 2
  echo "=== $name (limit ${lim}s) starts at $(( $(date +%s) - T0 ))s"
  timeout -k 5 "$lim" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? ends at $(( $(date +%s) - T0 ))s"
  tail -n 30 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for s in "${@:-check attn tp parity}"; do for st in $s; do case $st in
  check) stage check "${CHECK_S:-85}" python3 benchmarks/gpu_correctness.py \
      --out="$OUT/check.json" --budget_s="${CHECK_BUDGET:-70}" ${CHECK_ARGS:-} ;;
  attn) stage attn "${ATTN_S:-160}" python3 -m sparsetp.bench attention --preset=targets \
      --out_dir="$OUT" --json_name=attention.json --noplots --budget_s="${ATTN_BUDGET:-130}" ;;
  tp) stage tp "${TP_S:-105}" python3 -m sparsetp.bench tp --preset=gpu2 --out_dir="$OUT" \
      --noplots --budget_s="${TP_BUDGET:-85}" ;;
  parity) export JAX_DEFAULT_MATMUL_PRECISION=highest; stage parity "${PARITY_S:-75}" \
      python3 tests/parity_test.py --device=gpu --tp_sizes="${PARITY_TP:-1,2}" --seq_lens=1000 \
      --num_heads=8 --head_dims=64 --block_sizes=64 --dtypes=float32 --batch=2 \
      --patterns=causal,bigbird,strided_causal,per_head_mix --block_patterns=bigbird \
      --report="$OUT/parity.json" ;;
  parity16) stage parity16 "${PARITY16_S:-90}" python3 tests/parity_test.py \
      ParityTest.test_attention --device=gpu --seq_lens=1000 --num_heads=8 \
      --head_dims="${PARITY16_D:-128}" \
      --block_sizes=64,128 --dtypes=bfloat16,float16 --batch=2 \
      --patterns=causal,local,bigbird,strided_causal,per_head_mix,longformer \
      --report="$OUT/parity16.json" ;;
  scaling) stage scaling "${SCALING_S:-420}" python3 benchmarks/gpt_scaling.py --preset=gpu2 \
      --out_dir="$OUT" --budget_s="${SCALING_BUDGET:-360}" ;;
  demo) stage demo_torch "${DEMO_S:-90}" python3 -m sparsetp demo --backend torch --tp 2 \
      --device cuda --dtype bfloat16
    stage demo_jax "${DEMO_S:-90}" python3 -m sparsetp demo --backend jax --tp 2 --device cuda \
      --dtype bfloat16 ;;
  ab) stage ab "${AB_S:-300}" python3 benchmarks/launch_ab.py --out="$OUT/ab.json" \
      --budget_s="${AB_BUDGET:-280}" ${AB_ARGS:---arms=tiles} ;;
  probe) PROBE_OUT=$OUT/probe_default.json PROBE_HLO=$OUT/probe_fwd_bwd_hlo.txt \
      stage probe_default "${PROBE_S:-60}" python3 benchmarks/jax_mlp_probe.py ;;
  probe_notriton)
    PROBE_OUT=$OUT/probe_notriton.json XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
      stage probe_notriton "${PROBE_S:-60}" python3 benchmarks/jax_mlp_probe.py ;;
  *) echo "unknown stage $st" ;;
esac; done; done
ls -la "$OUT"
