#!/bin/bash
# Issue 10 on `nvidia-h200-x2` in one device call (about 5 minutes of commands; see docs/bench_ep_h200_2gpu.md):
#   1. the 2-rank NCCL tests of the dispatcher (tests/test_gpu_dispatch.py -k two_ranks: fp32 exactness against one
#      process, and no synchronising CUDA call in an "all_to_all" block's forward and backward), plus the
#      one-process no-host-sync check on the torch experts backend;
#   2. `occult bench ep` at T = 16384, 128 and 4096 tokens per rank (Qwen1.5 trace and OLMoE shapes; "all_to_all" in
#      every mode, "padded" in dedup+refined with its forward also replayed as a CUDA graph, transformers' EP);
#   3. `occult bench realsize --skip-replica` (OLMoE-1B-7B, 16 layers, EP only: the replica's figures do not depend on
#      this code; greedy decode through the CUDA-graph path), if time is left.
# Run from the repository root on the device machine; it needs the transformers 5.24 wheel and the Qwen1.5 trace in
# $DATA (whl/*.whl, trace.npz; default .devdata/fastep), e.g. with the code copied into .devdata/fastep:
#   run(kind="nvidia-h200-x2", carry=[".devdata/fastep"], timeout_s=330, command="cd .devdata/fastep && DATA=$PWD bash docs/bench_ep_x2.sh")
# Results come back under $OUT (log.txt, exact.txt, ep.txt, realsize.txt and the tables); the last lines printed are the tables.
# Step limits (seconds): T_EXACT, T_EP, T_REAL; the whole script stops starting steps after T_TOTAL.
# Session 4's call ran the defaults. DISPATCHERS="all_to_all padded symm_mem" adds the NVSHMEM dispatcher's rows
# (dedup+refined, with its CUDA-graph replay); REALSIZE="" also times the data-parallel replica (the EP half took
# 36 s on 2026-11-30).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DATA=${DATA:-$ROOT/.devdata/fastep}
OUT=${OUT:-/tmp/out}
START=$(date +%s)
left() { echo $(( ${T_TOTAL:-315} - ($(date +%s) - START) )); }
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
# run "$2..." with a limit of min($1, time left) s; 20 s before it, dump the stacks of it and its children
bounded() {
  local limit=$1; shift
  local rest; rest=$(left); [ "$rest" -lt "$limit" ] && limit=$rest
  if [ "$limit" -lt 30 ]; then echo "skipped: $limit s left"; return 124; fi
  timeout "$limit" "$@" & local pid=$!
  ( sleep $((limit - 20)); for p in $(descendants $pid); do kill -USR1 "$p" 2>/dev/null; done ) & local dog=$!
  wait $pid; local rc=$?; kill $dog 2>/dev/null; return $rc
}
{
date -u; nvidia-smi -L; python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
echo "=== 1. 2-rank NCCL dispatcher tests, one-process no-host-sync (torch experts)"
OCCULT_TEST_COLLECTIVE_TIMEOUT_S=45 NCCL_DEBUG=WARN bounded ${T_EXACT:-70} python3 -m pytest -s -q -m gpu -p no:cacheprovider \
  tests/test_gpu_dispatch.py -k "two_ranks or (one_process and torch)" > $OUT/exact.txt 2>&1; echo "rc=$?"; grep -v "$F" $OUT/exact.txt | tail -25
date -u
echo "=== 2. bench ep, T = 16384, 128, 4096"
bounded ${T_EP:-165} torchrun --nproc-per-node 2 -m occult_hf.cli bench ep --shapes qwen1.5-moe-a2.7b olmoe-1b-7b \
  --tokens 16384 128 4096 --iterations 5 --trace "$DATA/trace.npz" --dispatchers ${DISPATCHERS:-all_to_all padded} \
  --modes per_expert+contiguous dedup+contiguous dedup+refined transformers_ep --out $R > $OUT/ep.txt 2>&1; echo "rc=$?"; grep -v "$F" $OUT/ep.txt | tail -40
date -u
echo "=== 3. bench realsize --skip-replica (OLMoE-1B-7B, 16 layers)"
bounded ${T_REAL:-150} torchrun --nproc-per-node 2 -m occult_hf.cli bench realsize ${REALSIZE---skip-replica} --iterations 2 --new-tokens 32 --dispatchers \
  --out $R > $OUT/realsize.txt 2>&1; echo "rc=$?"; grep -v "$F" $OUT/realsize.txt | tail -20
date -u
} > $OUT/log.txt 2>&1
rm -f $R/bench_realsize_*.json  # few files come back
cat $R/bench_ep_2xcuda.md $R/bench_realsize_2xcuda.md 2>/dev/null; tail -30 $OUT/log.txt
