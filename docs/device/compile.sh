#!/bin/bash
# The GPU half of the compile work (issue 31) and of the restructure (issue 30) on one `nvidia-h200`: the steps named
# in STEPS run in order, each under its own time limit, in one device call of at most 10 minutes.
#   decode   `occult bench decode --models $MODEL` (batch 1, 8, 32, 64; dynamic and static cache; stock and occult
#            in one run; the fp32 greedy-token check; DECODE_ARGS adds arguments, e.g. --untracked or --isolate);
#   train    `occult bench model --compile` (4 layers at the real OLMoE and Qwen1.5 layer shapes, 16,384 tokens,
#            forward and forward+backward: stock eager, stock compiled, occult eager, occult compiled); TRAIN_PROFILE=N
#            adds each model's profile, compiled ones included (GPU busy against wall, the N costliest kernels);
#   tests    the GPU tests of the compiled paths and of the restructured runtime (tests/test_gpu_compile.py,
#            test_gpu_compile_ops.py, test_gpu_runtime.py, test_triton_kernels.py -m gpu, test_graph_settling.py -m gpu, test_gpu_dispatch.py
#            without its two-rank cases; TEST_FILES replaces that list); a test's own limit is TEST_TIMEOUT (default 600 s: a worker's first test
#            compiles and tunes every kernel, 8 workers at once), and the step's limit interrupts pytest (SIGINT)
#            so that a cut run still prints the failures' tracebacks;
#   profile  docs/device/profile_decode.py $PROFILE (default "dynamic static"; also "host", "tracking", "block", "crossover", "layers", "filtered"): where a step of generate() spends
#            its time (dynamic: host functions and synchronisations; static: GPU busy time against wall, top kernels);
#   alone    docs/device/tracking_alone.py: each of ALONE_VARIANTS (default "tracked untracked stock") in a fresh process,
#            ALONE_ROUNDS times (default 2), each round once unpinned and once under `taskset -c 2` (here SECONDS is
#            each process's limit, not the step's);
#   warmup   docs/device/warmup_rounds.py: each of WARMUP_VARIANTS (default "tracked untracked stock") in a fresh process, eight
#            rounds of a 64-token and a 1-token static-cache generate() and an eager prefill, each timed (SECONDS per process;
#            REUSE_CACHE=1: one StaticCache for every call; EARLY_INIT=1: a new one a call, allocated before the prefill;
#            ROUNDS, BATCH: the rounds (8) and the batch (1), BATCH distinct prompts; SNAPSHOT=1: the allocator's blocks
#            that came or went each round, by allocating frame, STACK of them);
#   order    docs/device/isolate_order.py: occult's `--isolate` process at batch 1, static only against dynamic then
#            static, ORDER_ROUNDS times (default 2), each in a fresh process;
#   sweep    docs/device/topk_sweep.py: the top-k decode kernels' launch configurations at the OLMoE and Qwen1.5 shapes;
#   idle     docs/device/train_idle.py $IDLE_MODELS (default "stock occult"): where the GPU idles in a compiled
#            forward+backward of `bench model`'s OLMoE shape, and the host ranges it waits on;
#   gemms    docs/device/grouped_mm_kinds.py: the six grouped GEMMs of a training step at OLMoE's expert shape, each
#            against a dense GEMM of the same sizes;
#   base     eager `occult bench model` of main at bb13be5 (the tree before the restructure, `git archive bb13be5
#            src kernels patches eval > .devdata/base.tar`) and of this tree, in one process each, one after the other.
# It needs the transformers 5.24 wheel in .whl/ (`pip download --no-deps transformers==5.24.0`); WHEELS names another
# folder of wheels to install instead (a newer transformers with the dependencies the image lacks), e.g.
#   run(kind="nvidia-h200", carry=[".whl", ".devdata"], timeout_s=600,
#       command="STEPS='decode:560' MODEL=olmoe-1b-7b bash docs/device/compile.sh")
# where each STEP:SECONDS gives the step's limit. Every step's tables and logs are packed into $OUT/results.tar.gz
# after the step (so a call cut short keeps the steps it finished), and the log of every step is $OUT/log.txt.
set -uo pipefail
STEPS=${STEPS:?set STEPS to a list of STEP:SECONDS (decode, train, tests, profile, alone, warmup, order, sweep, idle, gemms, base)}
MODEL=${MODEL:-olmoe-1b-7b}  # BATCHES (decode) defaults to "1 8 32 64"
REPO=$PWD
RESULTS=/tmp/results
mkdir -p "$RESULTS"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS:-.whl}"/*.whl || exit 1
stage() {  # copy a source tree into $2 as an importable occult_hf (setup.cfg's package_dir mapping by hand)
  mkdir -p "$2/occult_hf" && cp -r "$1"/src/occult_hf/* "$2/occult_hf/" && for d in kernels patches eval; do cp -r "$1/$d" "$2/occult_hf/$d"; done
}
stage . /tmp/now
export PYTHONPATH=/tmp/site:/tmp/now:$REPO/tests PYTHONUNBUFFERED=1
cd /tmp
nvidia-smi -L | tee -a "$OUT/log.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/log.txt"
for item in $STEPS; do
  step=${item%%:*} limit=${item##*:}
  echo "== $step (limit ${limit} s) $(date -u +%H:%M:%S)" | tee -a "$OUT/log.txt"
  case "$step" in
    decode)
      timeout "$limit" python3 -m occult_hf.cli bench decode --no-progress --models "$MODEL" --batches ${BATCHES:-1 8 32 64} --repeats 2 ${DECODE_ARGS:-} --out "$RESULTS/decode_$MODEL" 2>&1 | grep -v Warning | tee -a "$OUT/log.txt" ;;
    train)
      timeout "$limit" python3 -m occult_hf.cli bench model --no-progress --compile --batch 8 --seq 2048 ${TRAIN_PROFILE:+--profile $TRAIN_PROFILE} \
        --out "$RESULTS/train" 2>&1 | grep -v Warning | tee -a "$OUT/log.txt" ;;
    tests)
      timeout -s INT "$limit" python3 -m pytest -v -rf --tb=short --durations=20 --timeout=${TEST_TIMEOUT:-600} --maxfail=${MAXFAIL:-3} -n ${WORKERS:-8} -m gpu -p no:cacheprovider \
        $(printf "$REPO/%s " ${TEST_FILES:-tests/test_gpu_compile.py tests/test_gpu_compile_ops.py tests/test_gpu_runtime.py tests/test_triton_kernels.py tests/test_gpu_dispatch.py tests/test_graph_settling.py}) \
        -k "not two_ranks" > "$RESULTS/tests.txt" 2>&1; grep -E "PASSED|FAILED|ERROR|SKIPPED|^E |passed|failed" "$RESULTS/tests.txt" | tail -120 | tee -a "$OUT/log.txt" ;;
    profile)
      timeout "$limit" python3 "$REPO/docs/device/profile_decode.py" ${PROFILE:-dynamic static} > "$RESULTS/profile.txt" 2>&1; grep -v Warning "$RESULTS/profile.txt" | head -900 | tee -a "$OUT/log.txt" ;;
    alone)
      for round in $(seq "${ALONE_ROUNDS:-2}"); do
        for variant in ${ALONE_VARIANTS:-tracked untracked stock}; do
          for pin in "" "taskset -c 2"; do
            echo "-- round $round, $variant, ${pin:-unpinned}" | tee -a "$OUT/log.txt"
            timeout "$limit" $pin python3 "$REPO/docs/device/tracking_alone.py" "$variant" 2>&1 | grep "^alone" | tee -a "$OUT/log.txt"
          done
        done
      done ;;
    warmup)
      for variant in ${WARMUP_VARIANTS:-tracked untracked stock}; do
        timeout "$limit" python3 "$REPO/docs/device/warmup_rounds.py" "$variant" 2>&1 | grep "^warmup" | tee -a "$OUT/log.txt"
      done ;;
    order)
      timeout "$limit" python3 "$REPO/docs/device/isolate_order.py" "${ORDER_ROUNDS:-2}" 2>&1 | grep "^order" | tee -a "$OUT/log.txt" ;;
    sweep)
      timeout "$limit" python3 "$REPO/docs/device/topk_sweep.py" > "$RESULTS/sweep.txt" 2>&1; grep -E "^best|top 5" "$RESULTS/sweep.txt" | tee -a "$OUT/log.txt" ;;
    idle)
      timeout "$limit" python3 "$REPO/docs/device/train_idle.py" ${IDLE_MODELS:-stock occult} > "$RESULTS/idle.txt" 2>&1; grep -v Warning "$RESULTS/idle.txt" | tail -300 | tee -a "$OUT/log.txt" ;;
    gemms)
      timeout "$limit" python3 "$REPO/docs/device/grouped_mm_kinds.py" 2>&1 | grep -v Warning | tee -a "$OUT/log.txt" ;;
    base)
      mkdir -p /tmp/base_src && tar -xf "$REPO/.devdata/base.tar" -C /tmp/base_src && stage /tmp/base_src /tmp/base
      for tree in base now; do
        echo "-- $tree" | tee -a "$OUT/log.txt"
        PYTHONPATH=/tmp/site:/tmp/$tree timeout $((limit / 2)) python3 -m occult_hf.cli bench model --batch 8 --seq 2048 --out "$RESULTS/base_$tree" 2>&1 \
          | grep -v Warning | tail -8 | tee -a "$OUT/log.txt"
      done ;;
    *) echo "unknown step $step" | tee -a "$OUT/log.txt" ;;
  esac
  tar -czf "$OUT/results.tar.gz" -C "$RESULTS" .
done
echo "== done $(date -u +%H:%M:%S)" | tee -a "$OUT/log.txt"
