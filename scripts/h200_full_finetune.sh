#!/usr/bin/env bash
# The full fine-tuning measurements on one offline H200 (docs/full_finetune.md), in the two parts one device call
# each can hold. Run from the repository root on the GPU host, with the wheelhouse in .whl (../shared/gpu/README.md):
#   APEXW_COMMIT=<commit> bash scripts/h200_full_finetune.sh speed   $OUT   # smoke of every stack, then memory/speed
#   APEXW_COMMIT=<commit> bash scripts/h200_full_finetune.sh quality $OUT [apexw-compare args]   # >= 1,000 steps
#   APEXW_COMMIT=<commit> bash scripts/h200_full_finetune.sh steady  $OUT   # steps/s target, then the Unsloth smoke
#   APEXW_COMMIT=<commit> bash scripts/h200_full_finetune.sh memory  $OUT   # gradient release: what fits where
#   APEXW_COMMIT=<commit> bash scripts/h200_full_finetune.sh release_speed $OUT   # release vs none, 1B, in rounds
#   APEXW_COMMIT=<commit> bash scripts/h200_full_finetune.sh release_probe $OUT   # where the peaks and host time go
# One call holds the four cells the targets are about, 2 seeds x 2 learning rates (16 runs, 8 at a time):
#   ... quality $OUT --optimizers adamw_torch_fused@fp32,adamw_torch_fused@bf16,apexw_8bit@bf16,apexw_compact@bf16
# and a second call the three others (adamw_8bit@fp32,adamw_8bit@bf16,apexw_8bit@fp32) into another --output-dir.
# speed:   scripts/gpu_full_finetune_smoke.py (Trainer, SFTTrainer, Unsloth full fine-tuning, the fp16 error), then
#          the 7 optimizer/dtype cells one run at a time at seq 1024 x batch 4 (peak memory, steps/s).
# steady:  the steps/s target's two cells (adamw_torch_fused@fp32, apexw_8bit@bf16), 2 seeds x STEADY_STEPS (400)
#          steps each at seq 1024 x batch 4, one run at a time (steps_per_s_steady in each run's JSON leaves out the
#          first 10% of steps); then the smoke's SMOKE_STACKS (unsloth,fp16) within SMOKE_SECONDS (280).
# quality: configs/llama32_1b_full_h200.yaml, 4 runs sharing the GPU (peak memory is per process; steps/s there are
#          measured under sharing and are not the speed result).
# memory:  scripts/bench_full_finetune_memory.py through the Trainer: 1B shapes, each apexw format with and without
#          gradient release (+ Liger) and torch fused @fp32, MEMORY_STEPS_1B (60) steps; then 8B and 3B shapes, the
#          release + Liger cells and torch fused @fp32, 20 steps; then the 1B 4-bit pair again (a second sample of
#          the speed ratio, taken after the others); each within MEMORY_SECONDS (520) in all.
# release_speed: the 1B speed target of gradient release (s/step within 1.05x of the same optimizer without it):
#          the release CUDA tests; scripts/bench_release_overhead.py for apexw_4bit and apexw_8bit + Liger (one
#          process each, OVERHEAD_ROUNDS (6) rounds of 25-step blocks without and with release, alternating; with
#          RELEASE_BUCKET_ALT the 4-bit pair again at that bucket size); then through the Trainer apexw_8bit and
#          apexw_4bit + Liger, each without and with release,
#          RELEASE_ROUNDS (2) rounds of the four cells one after the other (pairs side by side in time; with
#          RELEASE_BUCKET_ALT the 4-bit release cell again at that bucket size), RELEASE_STEPS (50) steps each, 10 of
#          warm-up; then the 4-bit pair once with --time-calls (host time per function); the Trainer rounds and the
#          --time-calls pair only while RELEASE_SECONDS (560) since the part began last.
# release_probe: the two open targets of gradient release. (1) Llama-3.2-3B shapes at 11.06 GiB against <= 11:
#          apexw_4bit_release + Liger with --snapshot (what is alive at the peak, by site) at the default bucket and at
#          RELEASE_BUCKETS (8388608 16777216 elements: less gradient waiting for a launch, more launches), 12 steps;
#          then torchao's 8-bit and 4-bit in backward on 3B shapes (the "in backward" rows of the fits table).
#          (2) the 1B 4-bit pair with --profile 3 (host and GPU time of the release flushes against no release), and
#          the release cell again with buckets twice the default (half the flushes: host time against memory).
#          Within PROBE_SECONDS (540) in all.
# Each part leaves a tarball of its output directory and its log under $OUT.
set -uo pipefail
part=${1:?speed or quality}
out=${2:?output folder}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # the parts write their logs and tarballs here
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.txt"
case $part in
  speed)
    timeout 150 python3 scripts/gpu_full_finetune_smoke.py --out runs/full_smoke 2>&1 | tail -20 | tee "$out/smoke.txt"
    tar czf "$out/smoke.tgz" --exclude=model runs/full_smoke
    python3 -m apexw_hf.recipe.compare configs/llama32_1b_full_h200.yaml --seeds 0 --lrs 3e-4 \
      --set 'compare.lr_sweep={}' --set data.pad_to_multiple_of=1024 --set train.per_device_train_batch_size=4 \
      --set train.per_device_eval_batch_size=8 --set train.max_steps="${SPEED_STEPS:-120}" --set compare.jobs=2 \
      --set compare.runs_per_device=1 --set compare.max_minutes="${SPEED_MINUTES:-4}" \
      --output-dir runs/llama32_1b_full_h200_speed 2>&1 | tee "$out/speed.log" | grep -v "^{'loss'" | tail -40
    tar czf "$out/speed.tgz" --exclude=base --exclude=trainer runs/llama32_1b_full_h200_speed
    ;;
  steady)
    python3 -m apexw_hf.recipe.compare configs/llama32_1b_full_h200.yaml --seeds 0,1 --lrs 1e-4 \
      --optimizers adamw_torch_fused@fp32,apexw_8bit@bf16 \
      --set 'compare.lr_sweep={}' --set data.pad_to_multiple_of=1024 --set train.per_device_train_batch_size=4 \
      --set train.per_device_eval_batch_size=8 --set train.max_steps="${STEADY_STEPS:-400}" --set compare.jobs=2 \
      --set compare.runs_per_device=1 --set compare.max_minutes="${STEADY_MINUTES:-4}" \
      --output-dir runs/llama32_1b_full_h200_steady 2>&1 | tee "$out/steady.log" | grep -v "^{'loss'" | tail -40
    tar czf "$out/steady.tgz" --exclude=base --exclude=trainer runs/llama32_1b_full_h200_steady
    timeout "${SMOKE_SECONDS:-280}" python3 scripts/gpu_full_finetune_smoke.py --out runs/full_smoke \
      --stacks "${SMOKE_STACKS:-unsloth,fp16}" 2>&1 | tail -20 | tee "$out/smoke.txt"
    tar czf "$out/smoke.tgz" --exclude=model runs/full_smoke
    ;;
  quality)
    # the grid is stopped (its finished runs kept) before the device call's own limit, so the packing below runs
    timeout "${QUALITY_SECONDS:-480}" python3 -m apexw_hf.recipe.compare configs/llama32_1b_full_h200.yaml "${@:3}" \
      2>&1 | tee "$out/quality.log" | grep -v "^{'loss'" | tail -60
    python3 -m apexw_hf.recipe.compare configs/llama32_1b_full_h200.yaml "${@:3}" --report-only > /dev/null 2>&1
    tar czf "$out/quality.tgz" --exclude=base --exclude=trainer runs/llama32_1b_full_h200
    ;;
  memory)
    start=$SECONDS
    left() { echo $(( ${MEMORY_SECONDS:-520} - (SECONDS - start) )); }
    b=scripts/bench_full_finetune_memory.py
    pair4=apexw_4bit+liger@bf16,apexw_4bit_release+liger@bf16
    python3 $b --shapes 1b --steps "${MEMORY_STEPS_1B:-60}" --warmup 10 --timeout 120 --out runs/memory_1b \
      --cells $pair4,apexw_8bit+liger@bf16,apexw_8bit_release+liger@bf16,torch_fused@fp32 2>&1 | tee "$out/memory.log"
    python3 $b --shapes 8b,3b --steps 20 --warmup 4 --timeout 120 --out runs/memory_8b_3b \
      --cells apexw_4bit_release+liger@bf16,apexw_8bit_release+liger@bf16,torch_fused@fp32 2>&1 | tee -a "$out/memory.log"
    if [ "$(left)" -gt 80 ]; then
      python3 $b --shapes 1b --steps "${MEMORY_STEPS_1B:-60}" --warmup 10 --timeout 60 --out runs/memory_1b_again \
        --cells $pair4 2>&1 | tee -a "$out/memory.log"
    fi
    tar czf "$out/memory.tgz" --exclude=trainer runs/memory_1b runs/memory_8b_3b runs/memory_1b_again
    ;;
  release_speed)
    start=$SECONDS
    left() { echo $(( ${RELEASE_SECONDS:-560} - (SECONDS - start) )); }
    # the release kernels' CUDA tests first (the bucket norm kernel, release on the engine)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_release_norm.py \
      tests/kernels/test_gradient_release_engine.py 2>&1 | tail -3 | tee "$out/release_tests.txt"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/optim/test_gradient_release.py 2>&1 | tail -3 \
      | tee -a "$out/release_tests.txt"
    # one process per format: blocks without and with release alternate on one model (drift between processes cancels)
    # each run within min(200 s, what is left less 10 s)
    cap() { local l; l=$(left); echo $(( l - 10 < 200 ? l - 10 : 200 )); }
    for f in 4bit 8bit; do
      [ "$(cap)" -gt 60 ] || break
      timeout "$(cap)" python3 scripts/bench_release_overhead.py --shape 1b --format $f --liger \
        --rounds "${OVERHEAD_ROUNDS:-6}" --steps 25 --warmup 5 --out "runs/release_overhead/1b_${f}_liger.json" 2>&1 \
        | grep -v "^\[transformers\]\|warn" | tee -a "$out/release_speed.log"
    done
    if [ -n "${RELEASE_BUCKET_ALT:-}" ] && [ "$(cap)" -gt 60 ]; then
      timeout "$(cap)" python3 scripts/bench_release_overhead.py --shape 1b --format 4bit --liger \
        --bucket "$RELEASE_BUCKET_ALT" --rounds "${OVERHEAD_ROUNDS:-6}" --steps 25 --warmup 5 \
        --out "runs/release_overhead/1b_4bit_liger_bucket$RELEASE_BUCKET_ALT.json" 2>&1 \
        | grep -v "^\[transformers\]\|warn" | tee -a "$out/release_speed.log"
    fi
    echo "tests and interleaved runs: $(( SECONDS - start )) s" | tee -a "$out/release_speed.log"
    tar czf "$out/release_overhead.tgz" runs/release_overhead 2>/dev/null  # kept if a later part runs out of time
    for r in $(seq 1 "${RELEASE_ROUNDS:-2}"); do
      [ "$(left)" -gt 200 ] || { echo "Trainer round $r skipped: $(left) s left" | tee -a "$out/release_speed.log"; break; }
      python3 scripts/bench_full_finetune_memory.py --shapes 1b --steps "${RELEASE_STEPS:-50}" --warmup 10 --timeout 90 \
        --out "runs/release_speed_r$r" \
        --cells apexw_8bit+liger@bf16,apexw_8bit_release+liger@bf16,apexw_4bit+liger@bf16,apexw_4bit_release+liger@bf16 \
        2>&1 | tee -a "$out/release_speed.log"
      # RELEASE_BUCKET_ALT (elements): the 4-bit release cell again at that bucket size, in the same round
      if [ -n "${RELEASE_BUCKET_ALT:-}" ]; then
        python3 scripts/bench_full_finetune_memory.py --shapes 1b --steps "${RELEASE_STEPS:-50}" --warmup 10 \
          --timeout 90 --out "runs/release_speed_r$r" --optim-args "release_bucket_size=$RELEASE_BUCKET_ALT" \
          --tag "bucket$RELEASE_BUCKET_ALT" --cells apexw_4bit_release+liger@bf16 2>&1 | tee -a "$out/release_speed.log"
      fi
    done
    # where the host time of release goes (wrappers around the optimizer's functions: a little slower than above)
    [ "$(left)" -gt 100 ] && python3 scripts/bench_full_finetune_memory.py --shapes 1b --steps 30 --warmup 10 \
      --timeout 90 --time-calls --out runs/release_time_calls \
      --cells apexw_4bit+liger@bf16,apexw_4bit_release+liger@bf16 2>&1 \
      | grep -v "^{'loss'" | tee -a "$out/release_speed.log"
    tar czf "$out/release_speed.tgz" --exclude=trainer runs/release_overhead runs/release_speed_r* \
      runs/release_time_calls 2>/dev/null
    ;;
  release_probe)
    start=$SECONDS
    left() { echo $(( ${PROBE_SECONDS:-540} - (SECONDS - start) )); }
    b=scripts/bench_full_finetune_memory.py
    python3 $b --shapes 3b --steps 12 --warmup 4 --timeout 100 --out runs/probe_3b --snapshot \
      --cells apexw_4bit_release+liger@bf16 2>&1 | tee -a "$out/release_probe.log"
    for n in ${RELEASE_BUCKETS:-8388608 16777216}; do
      [ "$(left)" -gt 200 ] || break
      python3 $b --shapes 3b --steps 12 --warmup 4 --timeout 100 --out runs/probe_3b --snapshot \
        --optim-args "release_bucket_size=$n" --tag "bucket$n" --cells apexw_4bit_release+liger@bf16 2>&1 \
        | tee -a "$out/release_probe.log"
    done
    if [ "$(left)" -gt 150 ]; then
      python3 $b --shapes 1b --steps 30 --warmup 10 --timeout 75 --out runs/probe_1b --profile 3 \
        --cells apexw_4bit+liger@bf16,apexw_4bit_release+liger@bf16 2>&1 | tee -a "$out/release_probe.log"
      python3 $b --shapes 1b --steps 30 --warmup 10 --timeout 75 --out runs/probe_1b --profile 3 \
        --optim-args release_bucket_size=67108864 --tag bucket64m --cells apexw_4bit_release+liger@bf16 2>&1 \
        | tee -a "$out/release_probe.log"
    fi
    if [ "$(left)" -gt 120 ]; then
      python3 $b --shapes 3b --steps 8 --warmup 3 --timeout "$(( $(left) / 2 - 10 ))" --out runs/probe_3b_inbwd \
        --cells torchao_8bit_inbwd+liger@bf16,torchao_4bit_inbwd+liger@bf16 2>&1 | tee -a "$out/release_probe.log"
    fi
    tar czf "$out/release_probe.tgz" --exclude=trainer runs/probe_3b runs/probe_1b runs/probe_3b_inbwd 2>/dev/null
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
