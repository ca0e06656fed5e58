#!/usr/bin/env bash
# Run on a lent GPU machine, after benchmarks/device_bundle.py here (carry .whl and .gpu): the CUDA
# tests, then benchmarks/gpu_check.py in bf16 and fp32 on SmolLM2-135M's shape and in bf16 on a
# Llama-1B body; first benchmarks/launches.py (launches and engine ms of a solo vs a 4-run round). Each part is
# time-boxed; outputs land in $OUT when the device tool sets it. ~6 min.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
quiet() { grep -v "Loading weights\|Writing model"; }
echo "== launches and engine time of a round, solo vs 4 runs (no HTTP): bf16 1 x 32, then 2 x 256 per run"
timeout 120 python3 benchmarks/launches.py --device cuda --shape .gpu/smollm2-135m --time 5 --profile 2>&1 | quiet | tee "$OUT/launches.txt"
timeout 120 python3 benchmarks/launches.py --device cuda --shape .gpu/smollm2-135m --time 5 --profile --datums 2 \
  --tokens 256 2>&1 | quiet | tee -a "$OUT/launches.txt"
echo "== tests/gpu"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu -o addopts="" -rfE 2>&1 | tail -40 | tee "$OUT/tests.txt"
echo "== bf16, SmolLM2-135M shape, 8 x 512 tokens, 4 tenants x 2 x 256"
timeout 200 python3 benchmarks/gpu_check.py --shape .gpu/smollm2-135m 2>&1 | quiet | tee "$OUT/bf16.txt"
echo "== fp32, SmolLM2-135M shape, 8 x 512 tokens, 4 tenants x 1 x 32"
timeout 150 python3 benchmarks/gpu_check.py --shape .gpu/smollm2-135m --dtype float32 --steps 5 --tenant-rows 1 \
  --tenant-tokens 32 2>&1 | quiet | tee "$OUT/fp32.txt"
echo "== bf16, Llama-1B body, 8 x 1024 tokens, 4 tenants x 2 x 256"
timeout 150 python3 benchmarks/gpu_check.py --shape .gpu/llama-1b-body --tokens 1024 --steps 10 2>&1 | quiet | tee "$OUT/llama1b.txt"
