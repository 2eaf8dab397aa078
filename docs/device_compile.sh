#!/bin/bash
# The GPU half of the compile work and of the restructure on one `nvidia-h200`, in calls under 10 minutes each.
# STEP (one per call, in this order):
#   tests    the GPU tests of the compiled paths and of the restructured runtime: tests/test_gpu_compile.py
#            (inductor fullgraph equals eager in bf16 for every compilable family; static-cache generate with CUDA
#            graphs gives eager's tokens), tests/test_gpu_compile_ops.py, tests/test_gpu_runtime.py,
#            tests/test_gpu_dispatch.py -k "not two_ranks", tests/test_triton_kernels.py -m gpu;
#   decode   `occult bench decode --models olmoe-1b-7b` (batch 1, 8, 32, 64; dynamic and static cache; stock and
#            occult in one run; the fp32 greedy-token check), then the same for qwen1.5-moe-a2.7b in a second call
#            (MODEL=qwen1.5-moe-a2.7b);
#   train    `occult bench model --compile` (4 layers at the real OLMoE and Qwen1.5 layer shapes, 16,384 tokens,
#            forward+backward: stock eager, stock compiled, occult eager, occult compiled);
#   base     `occult bench model` of main at bb13be5 (the tree before the restructure, from `git archive` carried as
#            .devdata/base.tar) and of this tree, eager, in one call: the model-level speed before and after.
# It needs the transformers 5.24 wheel in .whl/ (`pip download --no-deps transformers==5.24.0`), e.g.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=590, command="STEP=decode bash docs/device_compile.sh")
# Results come back under $OUT (log.txt and the benchmarks' .md/.json); docs/runtime.md says where they go.
set -uo pipefail
STEP=${STEP:?set STEP to tests, decode, train or base}
MODEL=${MODEL:-olmoe-1b-7b}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
stage() {  # copy a source tree into $2 as an importable occult_hf (setup.cfg's package_dir mapping by hand)
  mkdir -p "$2/occult_hf" && cp -r "$1"/src/occult_hf/* "$2/occult_hf/" && for d in kernels patches eval; do cp -r "$1/$d" "$2/occult_hf/$d"; done
}
stage . /tmp/now
export PYTHONPATH=/tmp/site:/tmp/now:$PWD/tests PYTHONUNBUFFERED=1
cd /tmp
case "$STEP" in
  tests)
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider "$OLDPWD"/tests/test_gpu_compile.py "$OLDPWD"/tests/test_gpu_compile_ops.py \
      "$OLDPWD"/tests/test_gpu_runtime.py "$OLDPWD"/tests/test_triton_kernels.py "$OLDPWD"/tests/test_gpu_dispatch.py -k "not two_ranks" 2>&1 | tee "$OUT/log.txt" | tail -30 ;;
  decode)
    timeout 570 python3 -m occult_hf.cli bench decode --no-progress --models "$MODEL" --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/log.txt" | tail -30 ;;
  train)
    timeout 570 python3 -m occult_hf.cli bench model --no-progress --compile --batch 8 --seq 2048 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/log.txt" | tail -30 ;;
  base)
    mkdir -p /tmp/base_src && tar -xf "$OLDPWD/.devdata/base.tar" -C /tmp/base_src && stage /tmp/base_src /tmp/base
    for tree in base now; do
      echo "== $tree" | tee -a "$OUT/log.txt"
      PYTHONPATH=/tmp/site:/tmp/$tree timeout 270 python3 -m occult_hf.cli bench model --batch 8 --seq 2048 --out "$OUT/$tree" 2>&1 \
        | grep -v Warning | tee -a "$OUT/log.txt" | tail -8
    done ;;
  *) echo "unknown STEP=$STEP"; exit 2 ;;
esac
