#!/bin/bash
# Issue 10 on `nvidia-h200-x2` in one device call (at most about 10 minutes of commands; see docs/bench_ep_h200_2gpu.md):
#   0. a bare NCCL world through tests/distributed.py's run_world (an all_reduce, an all_to_all_single);
#   1. the 2-rank NCCL fp32 exactness test alone (tests/test_gpu_dispatch.py; stacks of every process are dumped
#      before its time limit, so a hang shows where it waits);
#   2. the one-process GPU checks (no host sync) and the static/decode dispatchers under NCCL;
#   3. `occult bench ep` at T = 128, 4096 and 16384 tokens per rank (Qwen1.5 trace and OLMoE shapes);
#   4. `occult bench model` on GPU 0 (4 layers, 16,384 tokens, against stock transformers), if time is left.
# Run from the repository root on the device machine; it needs the transformers 5.24 wheel and the Qwen1.5
# trace carried in .devdata/fastep/ (whl/*.whl, trace.npz), e.g. the lead's call:
#   run(kind="nvidia-h200-x2", carry=[".devdata/fastep"], timeout_s=600, command="bash docs/bench_ep_x2.sh")
# Results come back under $OUT (log.txt, probe.txt, exact.txt with the static tests' output, ep.txt, the tables); the last lines printed are the tables.
# The x2 machine's start took about 200 s on 2026-11-30: budget about 9 minutes of device time for the call.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DATA=${DATA:-$ROOT/.devdata/fastep}
OUT=${OUT:-/tmp/out}
cd "$ROOT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$DATA"/whl/*.whl || exit 1
# the package as the wheel lays it out (kernels/, patches/, eval/ are subpackages), from this checkout
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r src/occult_hf /tmp/pkg/ && for d in kernels patches eval; do cp -r $d /tmp/pkg/occult_hf/$d; done
# every Python process (pytest's ranks too) dumps its stacks on SIGUSR1
mkdir -p /tmp/diag && printf 'import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n' > /tmp/diag/sitecustomize.py
export PYTHONPATH=/tmp/diag:/tmp/site:/tmp/pkg:$ROOT/tests
R=$OUT/r; mkdir -p $R
F="Warning\|Loading weights\|Writing model\|output = func\|USDT\|warn(\|^|\|^$"
descendants() { local c; for c in $(ps -o pid= --ppid "$1"); do echo "$c"; descendants "$c"; done; }
# run "$2..." with a limit of $1 s; at $1 - 25 s, dump the stacks of it and its children
bounded() {
  local limit=$1; shift
  timeout "$limit" "$@" & local pid=$!
  ( sleep $((limit - 25)); for p in $(descendants $pid); do kill -USR1 "$p" 2>/dev/null; done ) & local dog=$!
  wait $pid; local rc=$?; kill $dog 2>/dev/null; return $rc
}
{
date -u; nvidia-smi -L; python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
echo "=== 0. run_world's NCCL world alone (an all_reduce and an all_to_all_single, no occult code)"
cat > /tmp/diag/nccl_probe.py <<'PY'
import time
import torch
import torch.distributed as dist
def probe(rank, world_size):
    x = torch.full((4,), float(rank), device=f"cuda:{rank}")
    dist.all_reduce(x)
    out = torch.empty(4, device=x.device)
    dist.all_to_all_single(out, torch.arange(4.0, device=x.device) + 10 * rank)
    torch.cuda.synchronize()
    return x.tolist(), out.tolist()
if __name__ == "__main__":
    from distributed import run_world
    from nccl_probe import probe  # by module name: the ranks unpickle it from there
    start = time.time()
    print(run_world(probe, 2, backend="nccl", timeout_s=60), f"{time.time() - start:.1f} s")
PY
bounded 80 python3 /tmp/diag/nccl_probe.py > $OUT/probe.txt 2>&1; PROBE=$?; echo "rc=$PROBE"; tail -15 $OUT/probe.txt
date -u
if [ $PROBE -ne 0 ]; then echo "=== 1., 2. skipped: run_world's bare NCCL world failed (see probe.txt)"; else
echo "=== 1. 2-rank NCCL fp32 exactness (alone)"
# a collective that waits 60 s makes NCCL's watchdog name it (the ranks report it) before the limit
OCCULT_TEST_COLLECTIVE_TIMEOUT_S=60 NCCL_DEBUG=WARN bounded ${T_EXACT:-150} python3 -m pytest -s -q -m gpu -p no:cacheprovider \
  tests/test_gpu_dispatch.py -k two_ranks > $OUT/exact.txt 2>&1; echo "rc=$?"; grep -v "$F" $OUT/exact.txt | tail -25
date -u
echo "=== 2. one-process GPU checks, static dispatchers under NCCL"
bounded 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_dispatch.py -k one_process 2>&1 | tail -5
OCCULT_TEST_COLLECTIVE_TIMEOUT_S=40 NVSHMEM_SYMMETRIC_SIZE=4G bounded ${T_STATIC:-75} python3 -m pytest -s -q -m gpu -p no:cacheprovider \
  tests/test_gpu_static_dispatch.py > $OUT/static.txt 2>&1; echo "rc=$?"; tail -15 $OUT/static.txt
  { echo "=== static dispatchers"; cat $OUT/static.txt; } >> $OUT/exact.txt; rm -f $OUT/static.txt  # at most 8 files come back
fi
date -u
echo "=== 3. bench ep, T = 128, 4096, 16384"
bounded ${T_EP:-140} torchrun --nproc-per-node 2 -m occult_hf.cli bench ep --shapes qwen1.5-moe-a2.7b olmoe-1b-7b \
  --tokens 16384 4096 128 --iterations 3 --trace "$DATA/trace.npz" --dispatchers all_to_all \
  --modes per_expert+contiguous dedup+contiguous dedup+refined transformers_ep --out $R > $OUT/ep.txt 2>&1; grep -v "$F" $OUT/ep.txt | tail -30
date -u
echo "=== 4. bench model, GPU 0"
CUDA_VISIBLE_DEVICES=0 bounded ${T_MODEL:-80} python3 -m occult_hf.cli bench model --warmup-ms 20 --rep-ms 100 --out $R 2>&1 | grep -v "$F" | tail -8
date -u
} > $OUT/log.txt 2>&1
rm -f $R/*.png  # at most 8 files come back
cat $R/bench_ep_2xcuda.md $R/bench_model_cuda.md 2>/dev/null; tail -40 $OUT/log.txt
