set -u
cd .gpu
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD APEXW_COMMIT=45d5cbb
o=$OUT/s; mkdir -p $o; echo "45d5cbb $(date -u +%FT%TZ)" > $o/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $o/gpu.txt
r4=apexw_4bit_release+liger@bf16
for b in 16777216 8388608; do
python3 scripts/bench_full_finetune_memory.py --shapes 3b --steps 12 --warmup 4 --timeout 150 --out $PWD/runs/b$b --cells $r4 --optim-args release_bucket_size=$b --tag bucket$b 2>&1 | grep -E "^3b|rror" | tee -a $o/log.txt
done
python3 scripts/bench_full_finetune_memory.py --shapes 3b --steps 12 --warmup 4 --timeout 150 --out $PWD/runs/snap --cells $r4 --snapshot 2>&1 | grep -E "^3b|rror" | tee -a $o/log.txt
tar -czf $OUT/s.tgz --exclude=trainer --exclude=model runs -C $OUT s
