#!/bin/bash
# occult bench paper on nvidia-h200-x2 (issue 19, docs/paper_comparison.md): one device call.
#   bash docs/paper_x2.sh 1   # OLMoE-1B-7B and Qwen1.5-MoE-A2.7B, prefill then fine-tuning (limit 540 s)
#   bash docs/paper_x2.sh 2   # the occult fine-tuning rows of OLMoE and Qwen1.5 again, with FSDP2 beside them
#                             # (call 1's failed under bf16 autocast), then DeepSeek-MoE-16B, prefill then
#                             # fine-tuning (limit 330 s: the re-run at most RERUN_LIMIT of it)
#   bash docs/paper_x2.sh megablocks   # MegaBlocks: installs it (the carried wheels, else built from the carried
#                             # sdists), runs tests/test_gpu_runtime.py (its MegaBlocks test), then per model the megablocks rows with
#                             # occult_hf's contiguous rows and the baselines beside them, in the same run (limit 420 s)
# from the checkout's root, with carry=[".devdata/paper"] holding the transformers 5.24 wheel and the Qwen
# trace as qwen_trace.npz (DATA, default .devdata/paper; the study trace is in docs/quality_results/).
# Env: EXTRA (more `bench paper` arguments for every run of the call, e.g. "--scale tiny --cpu"), MODELS (overrides
# the models of the call's main run), RERUN_MODELS (call 2's re-run; "" skips it), RERUN_LIMIT (s, default
# 150), LIMIT (s: the whole call's runs, default 540 / 330), NO_INSTALL=1 (use the installed transformers: the
# CPU check), ROOT (the checkout, default $PWD), PKG (where the package is assembled, default /tmp/pkg),
# THREADS (OMP threads per rank, default 4).
# Results: $OUT/paper/paper_comparison_2x<device>.md/.json (call 2: $OUT/paper/rerun/ and $OUT/paper/deepseek/)
# after every row, .png after every model; $OUT/log.txt (rows with elapsed seconds), $OUT/log_full.txt
# (everything, progress bars too). Call megablocks: MB_WHEELS (default $DATA/megablocks_whl) holds the wheels of
# megablocks, stanford-stk and grouped_gemm if built before; otherwise they are built from $DATA/megablocks_src
# (TORCH_CUDA_ARCH_LIST=9.0) into $OUT/wheels, to carry next time; its .png is left out (the device tool returns
# 8 files). GPU_TEST=0 skips tests/test_gpu_runtime.py (its MegaBlocks test) (default: run it before the rows).
set -u
CALL=${1:?call number: 1 or 2}
case $CALL in
  1) DEFAULT_MODELS="olmoe-1b-7b qwen1.5-moe-a2.7b"; DEFAULT_LIMIT=540; DEFAULT_RERUN="" ;;
  2) DEFAULT_MODELS="deepseek-moe-16b"; DEFAULT_LIMIT=330; DEFAULT_RERUN="olmoe-1b-7b qwen1.5-moe-a2.7b" ;;
  megablocks) DEFAULT_MODELS="olmoe-1b-7b qwen1.5-moe-a2.7b deepseek-moe-16b"; DEFAULT_LIMIT=420; DEFAULT_RERUN="" ;;
  *) echo "call must be 1, 2 or megablocks, got $CALL"; exit 2 ;;
esac
MODELS=${MODELS:-$DEFAULT_MODELS}
RERUN_MODELS=${RERUN_MODELS-$DEFAULT_RERUN}
RERUN_LIMIT=${RERUN_LIMIT:-150}
EXTRA=${EXTRA:-}
LIMIT=${LIMIT:-$DEFAULT_LIMIT}
OUT=${OUT:-/tmp/out}
ROOT=${ROOT:-$PWD}
DATA=$(cd "${DATA:-$ROOT/.devdata/paper}" && pwd) || exit 1
PKG=${PKG:-/tmp/pkg}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-4} TOKENIZERS_PARALLELISM=false
cd "$ROOT" || exit 1
if [ -z "${NO_INSTALL:-}" ]; then  # transformers 5.24 (the machine has 5.17: no ep_implementation)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$DATA"/transformers-*.whl || exit 1
fi
# the package as the wheel lays it out (kernels/, patches/, eval/ are subpackages), from this checkout
rm -rf "$PKG" && mkdir -p "$PKG" && cp -r src/occult_hf "$PKG"/ && for d in kernels patches eval; do cp -r $d "$PKG"/occult_hf/$d; done
export PYTHONPATH=/tmp/site:$PKG
# the prefill's checkpoint rows save the model once and load it four times: in RAM when /dev/shm has 80 GB
if [ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -gt 80000000 ] 2>/dev/null; then export TMPDIR=/dev/shm; fi
mkdir -p "$OUT/paper" && : > "$OUT/log_full.txt"

# megablocks_install: MegaBlocks into /tmp/site, from MB_WHEELS if it holds them, else built here (both extensions at once)
megablocks_install() {
  local wheels=${MB_WHEELS:-$DATA/megablocks_whl} start=$(date +%s) src
  if ! ls "$wheels"/megablocks-*.whl > /dev/null 2>&1; then
    wheels=$OUT/wheels && mkdir -p "$wheels" /tmp/mbsrc
    for src in "$DATA"/megablocks_src/*.tar.gz; do tar xzf "$src" -C /tmp/mbsrc || return 1; done
    # megablocks 0.10.0's cumsum passes CUB's debug_synchronous argument, which CUDA 13's CUB (CCCL 3) removed
    python3 - /tmp/mbsrc/megablocks_*/csrc/cumsum.h <<'PATCH' || return 1
import re, sys
text = open(sys.argv[1]).read()
open(sys.argv[1], "w").write(re.sub(r"stream,\s*debug_synchronous\)\);", "stream));", text))
PATCH
    for src in /tmp/mbsrc/*/; do
      (cd "$src" && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip wheel -q --no-deps --no-build-isolation --no-index \
        -w "$wheels" . > "$src/build.log" 2>&1 || { echo "== build failed in $src:"; tail -40 "$src/build.log"; }) &
    done
    wait
    echo "== MegaBlocks built from the sdists in $(($(date +%s) - start)) s: $(cd "$wheels" && ls)"
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheels"/*.whl || return 1
  python3 -c "import importlib.metadata as m, megablocks, megablocks_ops, grouped_gemm, stk; print('megablocks', m.version('megablocks'), 'imports')"
}
F="Warning\|warn(\|Loading weights\|Writing model\|it/s\]\|s/it\]\|^ *$"
DEADLINE=$(($(date +%s) + LIMIT))

# bench NAME DIR CAP MODELS ARGS...: one torchrun of `bench paper`, cut at CAP s or the call's deadline
bench() {
  local name=$1 dir=$2 cap=$3 models=$4; shift 4
  local left=$((DEADLINE - $(date +%s)))
  [ "$cap" -lt "$left" ] && left=$cap
  if [ "$left" -le 10 ]; then echo "== $name: not started, $left s left of the call's $LIMIT s"; return; fi
  mkdir -p "$dir"
  echo "== $name: models $models, args $* $EXTRA, limit $left s"
  timeout "$left" torchrun --nproc-per-node 2 -m occult_hf.cli bench paper --models $models \
    --machine-kind nvidia-h200-x2 --trace "qwen1.5-moe-a2.7b=$DATA/qwen_trace.npz" --collective-timeout-s 120 \
    --out "$dir" "$@" $EXTRA 2>&1 | tee -a "$OUT/log_full.txt" | tr '\r' '\n' | grep -v "$F"
  echo "== $name: exit status ${PIPESTATUS[0]} (124: cut at $left s; the rows measured are in $dir)"
}

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m | head -3
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  echo "TMPDIR=${TMPDIR:-/tmp} call $CALL: models $MODELS, re-run $RERUN_MODELS, extra: $EXTRA, limit: $LIMIT s"
  if [ "$CALL" = 1 ]; then
    bench "call 1" "$OUT/paper" "$LIMIT" "$MODELS" --experiment all
  elif [ "$CALL" = megablocks ]; then
    megablocks_install
    if [ "${GPU_TEST:-1}" = 1 ]; then
      echo "== tests/test_gpu_runtime.py (its MegaBlocks test)"
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py -k megablocks 2>&1 | tail -15
    fi
    # MegaBlocks has no placement (experts contiguous): occult_hf's rows beside it use the contiguous one too
    bench "megablocks" "$OUT/paper" "$LIMIT" "$MODELS" --experiment all --placement-method contiguous \
      --rows stock_1gpu occult_contiguous megablocks fsdp2 occult_exact
    rm -f "$OUT"/paper/*.png
  else
    if [ -n "$RERUN_MODELS" ]; then
      bench "re-run of the occult fine-tuning rows" "$OUT/paper/rerun" "$RERUN_LIMIT" "$RERUN_MODELS" \
        --experiment finetune --rows occult_exact occult_pruned fsdp2
    fi
    bench "call 2" "$OUT/paper/deepseek" "$LIMIT" "$MODELS" --experiment all
  fi
  date -u
} 2>&1 | tee "$OUT/log.txt" | tail -c 11000
