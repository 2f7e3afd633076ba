set -u
cd .gpu
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
o=$OUT/s; mkdir -p $o
NEW=c857abd; OLD=453d5d2
echo "new $NEW old $OLD $(date -u +%FT%TZ)" > $o/commit.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $o/gpu.txt
python3 -c "import torch,triton,transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $o/gpu.txt
# GPU tests of the changed code (new tree)
PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q -x -m "gpu or not gpu" tests/kernels/test_release_norm.py tests/kernels/test_gradient_release_engine.py tests/optim/test_gradient_release.py tests/kernels/test_engine.py "tests/kernels/test_adamw_kernel.py::test_grad_scale_is_the_in_place_multiply" 2>&1 | tail -4 | tee $o/tests.txt
a4=apexw_4bit+liger@bf16; r4=apexw_4bit_release+liger@bf16
run() {  # tree cells outdir
  ( cd $1 && PYTHONPATH=/tmp/site:$PWD APEXW_COMMIT=$([ $1 = . ] && echo $NEW || echo $OLD) timeout 200 python3 scripts/bench_full_finetune_memory.py --shapes 1b --steps 60 --warmup 10 --timeout 150 --out $3 --cells $2 2>&1 | grep -E "^1b|rror" | sed "s/^/$([ $1 = . ] && echo new || echo old) /" | tee -a $o/log.txt )
}
run . $r4 $PWD/runs/p1_new_r4
run . $a4 $PWD/runs/p1_new_a4
run old $r4 $PWD/runs/p1_old_r4
echo "t=$((SECONDS-start))" | tee -a $o/log.txt
run old $r4 $PWD/runs/p2_old_r4
run . $a4 $PWD/runs/p2_new_a4
run . $r4 $PWD/runs/p2_new_r4
echo "t=$((SECONDS-start))" | tee -a $o/log.txt
if [ $((SECONDS-start)) -lt 420 ]; then
  ( PYTHONPATH=/tmp/site:$PWD APEXW_COMMIT=$NEW timeout $((540-SECONDS+start)) python3 scripts/bench_full_finetune_memory.py --shapes 1b --steps 40 --warmup 10 --time-calls --timeout 120 --out $PWD/runs/tc_new --cells $r4 2>&1 | grep -E "^1b|rror" | sed "s/^/new tc /" | tee -a $o/log.txt )
fi
tar -czf $OUT/s.tgz --exclude=trainer --exclude=model runs -C $OUT s
