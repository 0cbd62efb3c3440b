#!/usr/bin/env bash
# One call on a lent GPU machine (docs/gpu.md, "Running them on a lent GPU machine"): install the wheels
# carried in .whl, run the gpu-marked tests that need no model file, then the benchmarks. Logs go to $OUT
# when it is set. Usage: bash benchmarks/gpu_check.sh [model] [tests] [model-tests] [bench] [kv] [serve] [profile]
# `model`: collect the part of the bundled GGUF this call carried (benchmarks/gpu_model_parts.sh); the second
# call, made while the machine is warm, assembles it, and `model-tests` and `serve` then run what needs it.
# The issue-49 pair of calls: `model tests bench kv` with part-00, then `model model-tests serve` with part-01.
set -u
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
steps=${*:-tests bench profile}
for step in $steps; do
  case $step in
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
        tests/backends/test_cuda_fused.py tests/backends/test_attention_gpu.py tests/backends/compression/test_gpu.py \
        tests/backends/kv_transfer/test_tcp.py tests/backends/engine/test_sampler.py \
        tests/backends/engine/test_kv_tiers_devices.py tests/backends/engine/test_kv_tiers.py \
        tests/backends/kv_transfer/test_cuda_ipc.py 2>&1 | tee "$OUT/tests.log" | tail -6 ;;
    model)
      bash benchmarks/gpu_model_parts.sh collect ;;
    model-tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/backends/test_cuda_graphs.py \
        tests/backends/test_roles_cuda.py tests/backends/test_attention_gpu.py tests/backends/compression/test_smollm2.py \
        tests/backends/engine/test_kv_tiers.py 2>&1 | tee "$OUT/model-tests.log" | tail -6 ;;
    bench)
      python3 benchmarks/gpu_bench.py --sections bandwidth,models --models smollm2-shape,llama8b \
        --variants ${BENCH_VARIANTS:-torch,fused+split} --no-eager --no-generate 2>&1 | grep -v "^INFO\|^WARNING" \
        | tee "$OUT/bench.log" ;;
    kv)
      python3 benchmarks/gpu_kv_transfer.py --reps 5 2>&1 | grep -v "^INFO\|^WARNING" | tee "$OUT/kv.log" ;;
    serve)
      python3 benchmarks/gpu_serve.py --json "$OUT/serve.json" 2>&1 | grep -v "^INFO\|^WARNING" \
        | tee "$OUT/serve.log" ;;
    profile)
      python3 benchmarks/gpu_profile.py --models smollm2-shape,llama8b --variants fused+split --decode-configs 2>&1 \
        | tee "$OUT/profile.log" | grep -v "^INFO\|^WARNING\|UserWarning\|_warn_once" ;;
  esac
done
