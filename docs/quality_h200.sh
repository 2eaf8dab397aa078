#!/bin/bash
# The quality study of issue 34 on one H200 (docs/quality.md, "How the study of the stronger model runs"): the same
# command for every device call.
#   bash docs/quality_h200.sh
# from the checkout's root, with carry=[".devdata/pack", ".whl"]: the prepared data of the study_long recipe
# (occult train --prepare-only, without its hf_cache/) as one archive, .devdata/pack/study_long_data.tgz (14 MB; the
# 29 MB directory with the wheels and the repository passed the device tool's 64 MiB), unpacked here when DATA is
# absent, and the wheels of lm-eval 0.4.13, datasets 5.2.0, dill 0.4.1 and multiprocess 0.70.19, which the machine's
# image lacks. Each call runs the pipeline for BUDGET seconds (default 540 while the base job is to run, 480 once it is
# done: the installs take about 25 s before the pipeline, and the pre-training with deterministic kernels 455-494 s of
# the base job); the work directory (WORK, default out/quality_work: an
# ignored path, so it stays on the machine between calls while
# the machine is held) lets the next call resume: the base job once (a pre-training the deadline cut goes on from its
# last checkpoint, every 300 steps), then the variants not yet done. The call prints
# "N of M variants done"; it exits 0 when all are, 2 when some are left for the next call, 1 on a failure.
# The workers share the GPU through CUDA MPS when the machine has its control daemon (started here, stopped at the end):
# without it every process takes its turn in time slices, and lm-eval, which reads the GPU twice per request, waits
# out every other worker's slice (docs/device/mps_probe.py on the H200: a scorer beside six trainers, 38 requests/s
# without MPS, 239 with it; 12,700 alone).
# Env: DATA (default .devdata/study_long/data), DATA_ARCHIVE (its .tgz, above), WORK, BUDGET, SIZE (default study; micro with a micro corpus: a CPU
# check of the script), PER_GPU (worker processes per GPU, default the size's), NO_INSTALL=1 (use what is installed),
# NO_MPS=1 (time slices, as before MPS), DEFAULT_KERNELS=1 (pre-train with PyTorch's default kernels: faster, not repeatable;
# for a study run whole on one machine, docs/device/quality_session.sh), EARLIER (an earlier session's quality_results.json, or several separated by spaces,
# carried with the data: its variants join this run's when this machine pre-trained the same base model, which the
# repeatable base job does on the same GPU kind and software; the pipeline checks a SHA-256 of the base job's outputs).
# Results in $OUT: quality_results.json, loss_curve.png, profiles_{train,heldout}.tar.gz, placements.tar.gz, tasks.tar.gz,
# logs.tar.gz (7 files: the device tool returns 8 at most, 16 MiB each).
set -u
ROOT=${ROOT:-$PWD}
OUT=${OUT:-/tmp/out}
DATA=${DATA:-$ROOT/.devdata/study_long/data}
DATA_ARCHIVE=${DATA_ARCHIVE:-$ROOT/.devdata/pack/study_long_data.tgz}
if [ ! -d "$DATA" ] && [ -f "$DATA_ARCHIVE" ]; then
  tar xzf "$DATA_ARCHIVE" -C "$ROOT/.devdata" || exit 1
fi
WORK=${WORK:-$ROOT/out/quality_work}
PKG=${PKG:-/tmp/pkg}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT" || exit 1
date -u
if [ -z "${NO_INSTALL:-}" ]; then
  # a later call on the same machine finds the wheels installed (about 25 s saved a call)
  if [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    ls .whl > /tmp/site/.wheels
  fi
  # the package as the wheel lays it out (kernels/, patches/, eval/ are subpackages), from this checkout
  rm -rf "$PKG" && mkdir -p "$PKG" && cp -r src/occult_hf "$PKG"/ && for d in kernels patches eval; do cp -r $d "$PKG"/occult_hf/$d; done
  export PYTHONPATH=/tmp/site:$PKG
fi
nvidia-smi -L 2>/dev/null
if [ -z "${NO_MPS:-}" ] && command -v nvidia-cuda-mps-control >/dev/null; then
  # the directories of docs/device/mps_probe.py's run; a daemon whose server cannot serve CUDA is stopped again
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d && python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    echo "CUDA MPS: daemon started"
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
  else
    echo quit | nvidia-cuda-mps-control 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "CUDA MPS: not serving (time slices)"
  fi
fi
# the default budget (header): 540 s while the base job is to run, 480 s once it is done
if [ -z "${BUDGET:-}" ]; then
  python3 -c "import sys; from pathlib import Path; from occult_hf.eval.studies.quality import base_done; sys.exit(not base_done(Path(sys.argv[1])))" "$WORK" \
    && BUDGET=480 || BUDGET=540
  echo "BUDGET=$BUDGET"
fi
EARLIER_ARGS=()
for results in ${EARLIER:-}; do EARLIER_ARGS+=(--earlier "$results"); done
python3 -m occult_hf.eval.studies.quality --data "$DATA" --work "$WORK" --out "$OUT" --size "${SIZE:-study}" --budget "$BUDGET" \
  ${PER_GPU:+--per-gpu $PER_GPU} ${DEFAULT_KERNELS:+--default-kernels} ${EARLIER_ARGS[@]+"${EARLIER_ARGS[@]}"}
STATUS=$?
df -h "$WORK" | tail -1
date -u
exit $STATUS
