#!/usr/bin/env bash
# One device call on an offline H200 (../shared/gpu/README.md; wheelhouse in .whl): the GPU tests (the kernel's and
# the plain-PyTorch engine's bits against the reference on the GPU, every format), the optimizer-step benchmark, and
# the Unsloth full fine-tuning smoke. Run from the repository root:
#   APEXW_COMMIT=<commit> bash scripts/h200_kernel_check.sh $OUT
# BENCH_OPTIMIZERS picks the benchmark's rows (default below: every baseline but torch.compile, whose compiles take
# minutes), BENCH_DEADLINE (s) bounds it; SMOKE_SECONDS bounds the smoke. Results: $OUT/gpu_tests.log,
# $OUT/step_h200.json (+ .log), $OUT/smoke.tgz (+ smoke.txt).
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out" && out=$(cd "$out" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.txt"
timeout "${TEST_SECONDS:-120}" python3 -m pytest -q -m gpu tests/kernels tests/optim/test_checkpoint.py \
  tests/optim/test_torch_engine_cuda.py -k 'not second_device' -p no:cacheprovider 2>&1 | tail -30 > "$out/gpu_tests.log"
tail -3 "$out/gpu_tests.log"
opts=${BENCH_OPTIMIZERS:-torch_fused torch_foreach bnb_adamw8bit torchao_adamw8bit torchao_adamw4bit \
apexw_compact_triton apexw_compact_auto apexw_8bit_triton apexw_8bit_auto apexw_8bit_nearest apexw_4bit_triton \
apexw_4bit_auto apexw_4bit_nearest}
# shellcheck disable=SC2086
timeout $((${BENCH_DEADLINE:-220} + 40)) python3 scripts/bench_step.py --deadline "${BENCH_DEADLINE:-220}" \
  --time-budget "${BENCH_BUDGET:-1.5}" --optimizers $opts --out "$out/step_h200.json" 2>&1 | tee "$out/step_h200.log" | tail -60
timeout "${SMOKE_SECONDS:-120}" python3 scripts/gpu_full_finetune_smoke.py --out runs/full_smoke \
  --stacks "${SMOKE_STACKS:-unsloth}" 2>&1 | tail -8 | tee "$out/smoke.txt"
tar czf "$out/smoke.tgz" --exclude=model runs/full_smoke
