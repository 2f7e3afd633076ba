set -u
cd .gpu
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD APEXW_COMMIT=91adabf
o=$OUT/s; mkdir -p $o; echo "91adabf $(date -u +%FT%TZ)" > $o/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $o/gpu.txt
timeout 150 python3 -m pytest -q -x -m "gpu or not gpu" tests/optim/test_gradient_release.py -k "offload or cuda" 2>&1 | tail -3 | tee $o/tests.txt
b=scripts/bench_full_finetune_memory.py
r4=apexw_4bit_release+liger@bf16; r8=apexw_8bit_release+liger@bf16
python3 $b --shapes 3b --steps 20 --warmup 4 --timeout 150 --out $PWD/runs/3b_off --cells $r4,$r8 --optim-args tied_grad_offload=true --tag offload 2>&1 | grep -E "^3b|rror" | tee -a $o/log.txt
python3 $b --shapes 3b --steps 20 --warmup 4 --timeout 150 --out $PWD/runs/3b --cells $r4 2>&1 | grep -E "^3b|rror" | tee -a $o/log.txt
python3 $b --shapes 1b --steps 60 --warmup 10 --timeout 150 --out $PWD/runs/1b_off --cells $r4 --optim-args tied_grad_offload=true --tag offload 2>&1 | grep -E "^1b|rror" | tee -a $o/log.txt
python3 $b --shapes 1b --steps 60 --warmup 10 --timeout 150 --out $PWD/runs/1b --cells $r4 2>&1 | grep -E "^1b|rror" | tee -a $o/log.txt
echo "t=$((SECONDS-start))" | tee -a $o/log.txt
if [ $((SECONDS-start)) -lt 420 ]; then
python3 $b --shapes 3b --steps 8 --warmup 4 --timeout 120 --out $PWD/runs/3b_off_snap --cells $r4 --optim-args tied_grad_offload=true --tag offload --snapshot 2>&1 | grep -E "^3b|rror" | tee -a $o/log.txt
fi
tar -czf $OUT/s.tgz --exclude=trainer --exclude=model runs -C $OUT s
