set -u
cd .gpu
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD APEXW_COMMIT=41c1d44
o=$OUT/s; mkdir -p $o; echo "41c1d44 $(date -u +%FT%TZ)" > $o/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $o/gpu.txt
b=scripts/bench_full_finetune_memory.py
python3 $b --shapes 1b --steps 40 --warmup 10 --time-calls --timeout 100 --out $PWD/runs/tc --cells apexw_4bit_release+liger@bf16 2>&1 | grep -vE "^\s*$" | grep -E "^1b|ms/step|rror" | tee -a $o/log.txt
python3 $b --shapes 1b --steps 60 --warmup 10 --timeout 100 --out $PWD/runs/p8 --cells apexw_8bit_release+liger@bf16,apexw_8bit+liger@bf16 2>&1 | grep -E "^1b|rror" | tee -a $o/log.txt
echo "t=$((SECONDS-start))" | tee -a $o/log.txt
tar -czf $OUT/s.tgz --exclude=trainer --exclude=model runs -C $OUT s
