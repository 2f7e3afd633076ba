#!/usr/bin/env bash
# Issue 27's LoRA grid on one offline H200, in one device call: apexw_4bit (format version 2) at the bracketed
# learning rates 6e-4, 1.5e-3 and 3e-3, and beside it, in the same call, torch AdamW and apexw_8bit at 1.5e-3 (the
# best lr of every optimizer in the version-1 grid, docs/lora_recipe.md) and 3e-3 (where version 1 lost +0.32):
# 2 seeds each, 14 runs sharing the GPU (two apexw-compare processes, started together; peak memory is per process,
# steps/s are measured under sharing and are not a speed result). The runs of the version-1 grid at the same lrs
# (docs/results/recipe_lora/h200_llama32_3b_random_0cac18f) are a check that the baselines repeat.
# Run from the repository root with the wheelhouse (`wheelhouse.sh --unsloth`) in .whl:
#   APEXW_COMMIT=<commit> bash scripts/gpu_four_bit_v2_lora.sh "$OUT"
# LORA_BASELINES=0: the 4-bit runs alone (after a change of the 4-bit encoding only: the baselines' bits do not
# depend on it, and the stored ones stand).
# Results: $OUT/lora_4bit_v2.tgz (both output folders: summary.md, results.csv, one JSON per run, logs).
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out" && out=$(cd "$out" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.txt"
cfg=configs/llama32_3b_h200_random.yaml
common=(--set compare.warmup_run=false --set compare.max_minutes=6)
timeout "${LORA_SECONDS:-540}" python3 -m apexw_hf.recipe.compare $cfg --optimizers apexw_4bit \
  --lrs 6e-4,1.5e-3,3e-3 --jobs 6 --set compare.runs_per_device=6 "${common[@]}" --output-dir runs/lora_4bit_v2 \
  > "$out/lora_4bit_v2.log" 2>&1 &
dirs=(runs/lora_4bit_v2)
if [ "${LORA_BASELINES:-1}" != 0 ]; then
  timeout "${LORA_SECONDS:-540}" python3 -m apexw_hf.recipe.compare $cfg --optimizers adamw_torch,apexw_8bit \
    --lrs 1.5e-3,3e-3 --jobs 8 --set compare.runs_per_device=8 "${common[@]}" --output-dir runs/lora_baselines \
    > "$out/lora_baselines.log" 2>&1 &
  dirs+=(runs/lora_baselines)
fi
wait
for d in "${dirs[@]}"; do
  python3 -m apexw_hf.recipe.compare $cfg --output-dir "$d" --report-only > /dev/null 2>&1
  tail -12 "$d/summary.md" 2>/dev/null
done
tar czf "$out/lora_4bit_v2.tgz" --exclude=base --exclude=trainer "${dirs[@]}" "$out"/lora_*.log 2>/dev/null
