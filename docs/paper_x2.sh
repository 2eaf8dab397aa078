#!/bin/bash
# occult bench paper on nvidia-h200-x2 (issue 19, docs/paper_comparison.md): one device call.
#   bash docs/paper_x2.sh 1   # OLMoE-1B-7B and Qwen1.5-MoE-A2.7B, prefill then fine-tuning
#   bash docs/paper_x2.sh 2   # DeepSeek-MoE-16B, prefill then fine-tuning
# from the checkout's root, with carry=[".devdata/paper"] holding the transformers 5.24 wheel and the Qwen
# trace as qwen_trace.npz (DATA, default .devdata/paper; the study trace is in docs/quality_results/).
# Env: EXTRA (more `bench paper` arguments, e.g. "--rows ..." to re-run what a cut call missed), MODELS
# (overrides the call's models), LIMIT (s, default 540: the call's 600 s less install and start),
# NO_INSTALL=1 (use the installed transformers: the CPU check), ROOT (the checkout, default $PWD), PKG
# (where the package is assembled, default /tmp/pkg), THREADS (OMP threads per rank, default 4).
# Results: $OUT/paper/paper_comparison_2x<device>.md/.json after every row, .png after every model;
# $OUT/log.txt (rows with elapsed seconds), $OUT/log_full.txt (everything, progress bars too).
set -u
CALL=${1:?call number: 1 or 2}
case $CALL in
  1) DEFAULT_MODELS="olmoe-1b-7b qwen1.5-moe-a2.7b" ;;
  2) DEFAULT_MODELS="deepseek-moe-16b" ;;
  *) echo "call must be 1 or 2, got $CALL"; exit 2 ;;
esac
MODELS=${MODELS:-$DEFAULT_MODELS}
EXTRA=${EXTRA:-}
LIMIT=${LIMIT:-540}
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
mkdir -p "$OUT/paper"
F="Warning\|warn(\|Loading weights\|Writing model\|it/s\]\|s/it\]\|^ *$"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m | head -3
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  echo "TMPDIR=${TMPDIR:-/tmp} models: $MODELS extra: $EXTRA limit: $LIMIT s"
  timeout "$LIMIT" torchrun --nproc-per-node 2 -m occult_hf.cli bench paper --experiment all --models $MODELS \
    --machine-kind nvidia-h200-x2 --trace "qwen1.5-moe-a2.7b=$DATA/qwen_trace.npz" --collective-timeout-s 120 \
    --out "$OUT/paper" $EXTRA 2>&1 | tee "$OUT/log_full.txt" | tr '\r' '\n' | grep -v "$F"
  echo "exit status ${PIPESTATUS[0]} (124: cut at $LIMIT s; the rows measured are in $OUT/paper)"
  date -u
} 2>&1 | tee "$OUT/log.txt" | tail -c 11000
