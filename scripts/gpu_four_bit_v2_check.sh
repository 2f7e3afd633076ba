#!/usr/bin/env bash
# GPU check of the 4-bit format version 2 (issue 27), for one device call on a CUDA host with triton installed:
# 1. bit equality of the Triton kernel with the reference on CUDA for 4-bit: the 4-bit tests of tests/kernels (they
#    run on the GPU when there is one: every code boundary and special value of quant_mv4/dequant_mv4, the kernel's
#    steps against reference.adamw_step_ref_, the engine) and the gpu-marked 4-bit checkpoint / CUDA-engine tests;
# 2. the optimizer-step benchmark, apexw_4bit (version 2) beside torch fused (and apexw_8bit) in the same process;
#    with V1_DIR set to a checkout of a329abf (the last commit with 4-bit version 1, made beforehand with
#    `mkdir -p runs/v1_4bit && git archive a329abf apexw_hf scripts | tar -x -C runs/v1_4bit`, carried to the device),
#    version 1's 4-bit step right
#    after, for issue 27's speed target (version 2's kernel time within 1.05x of version 1's);
# 3. tiles and register caps of the 4-bit kernel (scripts/four_bit_tiles.py, TILE_VARIANTS, default 1x1,1x1@64,1x1@68:
#    uncapped, the shipped cap and the next one up) timed interleaved in one process, with a bit check of each against the default plan; with V1_DIR, version 1's
#    kernel is timed beside them in the same process.
# Run from the repository root:  bash scripts/gpu_four_bit_v2_check.sh "$OUT"   (V1_DIR=runs/v1_4bit to add v1)
# Results: $OUT/gpu.txt, $OUT/kernel_tests.log, $OUT/gpu_marked_tests.log, $OUT/step_4bit_v2.json (+ .log),
# $OUT/step_4bit_v1.json (+ .log), $OUT/tiles.json (+ .log): nine files with V1_DIR, so pack $OUT into one tarball
# where a device call returns at most eight.
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out" && out=$(cd "$out" && pwd)
# the offline wheelhouse, where there is one (as scripts/h200_kernel_check.sh)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"
timeout "${TEST_SECONDS:-300}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_codes.py \
  tests/kernels/test_adamw_kernel.py tests/kernels/test_engine.py -k 4bit 2>&1 | tail -30 > "$out/kernel_tests.log"
tail -3 "$out/kernel_tests.log"
timeout "${TEST_SECONDS:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels \
  tests/optim/test_checkpoint.py tests/optim/test_torch_engine_cuda.py -k '4bit and not second_device' 2>&1 \
  | tail -30 > "$out/gpu_marked_tests.log"
tail -3 "$out/gpu_marked_tests.log"
opts="torch_fused apexw_4bit_triton apexw_4bit_auto apexw_8bit_triton"
# shellcheck disable=SC2086
timeout $((${BENCH_DEADLINE:-240} + 40)) python3 scripts/bench_step.py --deadline "${BENCH_DEADLINE:-240}" \
  --time-budget "${BENCH_BUDGET:-1.5}" --optimizers $opts --out "$out/step_4bit_v2.json" 2>&1 \
  | tee "$out/step_4bit_v2.log" | tail -40
if [ -n "${V1_DIR:-}" ]; then
  # shellcheck disable=SC2086
  (cd "$V1_DIR" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout $((${BENCH_DEADLINE:-240} + 40)) python3 \
    scripts/bench_step.py \
    --deadline "${BENCH_DEADLINE:-240}" --time-budget "${BENCH_BUDGET:-1.5}" --optimizers torch_fused \
    apexw_4bit_triton --out "$out/step_4bit_v1.json") 2>&1 | tee "$out/step_4bit_v1.log" | tail -40
fi
# shellcheck disable=SC2086
timeout "${TILES_SECONDS:-150}" python3 scripts/four_bit_tiles.py --variants "${TILE_VARIANTS:-1x1,1x1@64,1x1@68}" \
  ${V1_DIR:+--v1 "$V1_DIR"} --out "$out/tiles.json" 2>&1 | tee "$out/tiles.log" | tail -24
