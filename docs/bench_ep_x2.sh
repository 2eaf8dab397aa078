#!/bin/bash
# Issue 10 on `nvidia-h200-x2` in one device call (see docs/bench_ep_h200_2gpu.md). Steps, run in the order of $STEPS:
#   exact    the 2-rank NCCL tests of the dispatcher (tests/test_gpu_dispatch.py -k two_ranks: fp32 exactness against
#            one process, and no synchronising CUDA call in an "all_to_all" block's forward and backward), plus the
#            one-process no-host-sync check on the torch experts backend;
#   model    `occult bench model` (4 layers at the OLMoE and Qwen1.5 shapes, 16,384 tokens, one process against stock
#            transformers 5.24): one shape per GPU, both at once (each its own process and GPU);
#   realsize `occult bench realsize` (OLMoE-1B-7B, 16 layers): the data-parallel replica and EP in the same run (so
#            their ratio comes from one machine), greedy decode through the CUDA-graph path; REALSIZE=--skip-replica
#            times EP only;
#   ep       `occult bench ep` (Qwen1.5 trace and OLMoE shapes) at $TOKENS per rank, $DISPATCHERS x $MODES;
#   replicas `occult bench ep`, "all_to_all" at $REPLICA_TOKENS (default 16384): dedup+refined against refined with one
#            redundant expert slot per rank (at D=2: E/2 + 1 slots each, the hottest experts get a second home),
#            its pairs split over the homes by the static and by the load-aware rule (issue 14).
# PRESET=final (the last call of session 4): STEPS="model realsize ep replicas", ep with the "symm_mem" rows
# (dedup+refined, with its CUDA-graph replay) beside "all_to_all" dedup+refined and transformers' EP at T = 16384
# and 128. PRESET=session5: STEPS="exact realsize ep model", realsize with the replica, EP on the contiguous and on
# the "oracle" placement (planned on the timed batch: the balance bound) and a profile of each setup, ep "all_to_all"
# dedup+refined against transformers' EP at T = 16384 with a profile of each case (EP_EXTRA="--profile").
# PRESET=session6: the same steps for the host-read-free training path: realsize's EP row under dispatcher "auto" (which
# takes "padded" at OLMoE D=2) with its profile, beside "all_to_all" in the same run; ep "padded" and "all_to_all"
# dedup+refined against transformers' EP at T = 16384; exact with the "padded" NCCL cases; model with its profile (the
# MoE block's device time in both models).
# Without PRESET: session 4's first call (exact, ep with "all_to_all"/"padded" at 16384/128/4096, realsize
# --skip-replica). `bench ep` saves its table after every case: a hung case keeps the rows before it.
# Run from the repository root on the device machine; it needs the transformers 5.24 wheel and the Qwen1.5 trace in
# $DATA (whl/*.whl, trace.npz; default .devdata/fastep), e.g. the landed code with only the data carried:
#   run(kind="nvidia-h200-x2", carry=[".devdata/fastep"], timeout_s=450, command="PRESET=final bash docs/bench_ep_x2.sh")
# Results come back under $OUT: tables.md (every table as the doc shows them, the headers included, and the targets
# they decide), log.txt (the run's summary) and raw.tar.gz (each step's whole output, the json/md/png files); the
# last lines printed are tables.md. (If the call is cut before the end, the steps' logs lie in $OUT untarred.)
# Time: every step is limited to min(its limit, time left), and no step starts after T_TOTAL s (default 430 with
# PRESET=final, else 315); limits T_EXACT, T_MODEL, T_REAL, T_EP, T_REPLICAS;
# MODEL_EXTRA: more `bench model` flags (e.g. "--backends auto torch --profile 14"). DRY=1: a CPU dry run of the same steps
# at tiny sizes (no wheel, the current python; 2 gloo ranks), to check the script.
set -u
case "${PRESET:-}" in
  final) : "${STEPS:=model realsize ep replicas}" "${TOKENS:=16384 128}" "${DISPATCHERS:=all_to_all symm_mem}" "${REALSIZE:=}" \
           "${MODES:=dedup+refined transformers_ep}" "${T_TOTAL:=430}" "${T_EP:=130}" ;;
  session5) : "${STEPS:=exact realsize ep model}" "${TOKENS:=16384}" "${DISPATCHERS:=all_to_all}" "${REALSIZE:=--profile --placements contiguous oracle}" \
           "${MODES:=dedup+refined transformers_ep}" "${EP_EXTRA:=--profile}" "${T_TOTAL:=270}" "${T_EP:=75}" ;;
  session6) : "${STEPS:=exact realsize ep model}" "${TOKENS:=16384}" "${DISPATCHERS:=padded all_to_all}" \
           "${REALSIZE:=--profile --placements contiguous --dispatchers all_to_all}" "${MODES:=dedup+refined transformers_ep}" \
           "${EP_EXTRA:=--profile}" "${MODEL_EXTRA:=--profile 12}" "${T_TOTAL:=400}" "${T_EP:=120}" ;;
  "") ;;
  *) echo "PRESET=$PRESET: not a preset (final, session5, session6, or unset)"; exit 2 ;;
esac
: "${STEPS:=exact ep realsize}" "${TOKENS:=16384 128 4096}" "${DISPATCHERS:=all_to_all padded}" "${REALSIZE=--skip-replica}" \
  "${MODES:=per_expert+contiguous dedup+contiguous dedup+refined transformers_ep}" "${T_TOTAL:=315}" "${DRY:=}" \
  "${REPLICA_TOKENS:=16384}" "${EP_EXTRA:=}" "${MODEL_EXTRA:=}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-8G}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DATA=${DATA:-$ROOT/.devdata/fastep}
OUT=${OUT:-/tmp/out}
START=$(date +%s)
left() { echo $(( T_TOTAL - ($(date +%s) - START) )); }
cd "$ROOT"
WORK=$(mktemp -d)  # the wheel's install, the package copy, the raw results (few files come back from $OUT)
if [ -n "$DRY" ]; then
  # tiny sizes on CPU: the steps' logic, not their figures
  EP_SIZE="--hidden 32 --intermediate 16"; MODEL_SIZE="--layers 1 --batch 1 --seq 64 --hidden 64 --intermediate 32"
  REAL_SIZE="--layers 1 --hidden 64 --batch 1 --seq 32 --prompt 4 --new-tokens 2"; TOKENS_RUN="64"; NGPU=${NGPU:-0}
  REPLICA_TOKENS=64
  TRACE=${TRACE:-$ROOT/../shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz}
  export PYTHONPATH=$ROOT/src:$ROOT/tests
else
  EP_SIZE=""; MODEL_SIZE=""; REAL_SIZE="--new-tokens 32"; TOKENS_RUN=$TOKENS; NGPU=$(nvidia-smi -L | wc -l)
  TRACE=$DATA/trace.npz
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $WORK/site "$DATA"/whl/*.whl || exit 1
  # the package as the wheel lays it out (kernels/, patches/, eval/ are subpackages), from this checkout
  mkdir -p $WORK/pkg && cp -r src/occult_hf $WORK/pkg/ && for d in kernels patches eval; do cp -r $d $WORK/pkg/occult_hf/$d; done
  export PYTHONPATH=$WORK/diag:$WORK/site:$WORK/pkg:$ROOT/tests
  # the combine's Triton row sum (kernels.row_sum) is new: if it fails to compile or differs from torch here, the steps
  # run the PyTorch sum instead (said in the log) rather than losing every EP figure of the call
  python3 -c "import torch; from occult_hf.kernels import row_sum; x = torch.randn(9, 2048, device='cuda', dtype=torch.bfloat16); i = torch.randint(0, 9, (7, 2), device='cuda'); assert torch.equal(row_sum.sum_rows(x, i), torch.sum(x[i], 1, dtype=x.dtype))" \
    > $OUT/row_sum_check.txt 2>&1 || { echo "row_sum kernel FAILED its check (row_sum_check.txt): the steps run the PyTorch sum" | tee -a $OUT/row_sum_check.txt
    sed -i 's/^def available(rows_pad_OH: torch.Tensor) -> bool:$/&\n    return False  # bench_ep_x2.sh: the kernel failed its check on this machine/' $WORK/pkg/occult_hf/kernels/row_sum.py; }
fi
# every Python process (pytest's ranks too) dumps its stacks on SIGUSR1
mkdir -p $WORK/diag && printf 'import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n' > $WORK/diag/sitecustomize.py
R=$WORK/r; mkdir -p $R $OUT
TORCHRUN="python3 -m torch.distributed.run --nproc-per-node 2"
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

step_exact() {
  OCCULT_TEST_COLLECTIVE_TIMEOUT_S=45 NCCL_DEBUG=WARN bounded ${T_EXACT:-70} python3 -m pytest -s -q -m gpu -p no:cacheprovider \
    tests/test_gpu_dispatch.py tests/test_row_sum.py -k "two_ranks or (one_process and torch) or gpu_row_sums" > $OUT/exact.txt 2>&1; echo "rc=$?"; grep -v "$F" $OUT/exact.txt | tail -25
}

step_model() {  # one shape per GPU at once (on one GPU, or on CPU, one after the other)
  local shapes=(olmoe-1b-7b qwen1.5-moe-a2.7b) i pids=()
  if [ "$NGPU" -ge 2 ]; then
    for i in 0 1; do
      CUDA_VISIBLE_DEVICES=$i bounded ${T_MODEL:-150} python3 -m occult_hf.cli bench model --shapes ${shapes[$i]} $MODEL_SIZE $MODEL_EXTRA \
        --out $R/model$i > $OUT/model$i.txt 2>&1 & pids+=($!)
    done
    for i in 0 1; do wait ${pids[$i]}; echo "${shapes[$i]} (GPU $i): rc=$?"; done
  else
    bounded ${T_MODEL:-150} python3 -m occult_hf.cli bench model --shapes ${shapes[@]} $MODEL_SIZE $MODEL_EXTRA --out $R/model0 > $OUT/model0.txt 2>&1
    echo "rc=$?"
  fi
  grep -v "$F" $OUT/model*.txt | tail -12
}

step_realsize() {
  # no extra training dispatchers unless $REALSIZE names them (`--dispatchers padded symm_mem`: its later flag wins)
  bounded ${T_REAL:-150} $TORCHRUN -m occult_hf.cli bench realsize --dispatchers $REALSIZE --iterations 3 $REAL_SIZE \
    --out $R > $OUT/realsize.txt 2>&1; echo "rc=$?"; grep -v "$F" $OUT/realsize.txt | tail -20
}

step_ep() {
  bounded ${T_EP:-165} $TORCHRUN -m occult_hf.cli bench ep --shapes qwen1.5-moe-a2.7b olmoe-1b-7b $EP_SIZE \
    --tokens $TOKENS_RUN --iterations 5 --trace "$TRACE" --dispatchers $DISPATCHERS --modes $MODES $EP_EXTRA --out $R > $OUT/ep.txt 2>&1
  echo "rc=$?"; grep -v "$F" $OUT/ep.txt | tail -40
}

step_replicas() {
  bounded ${T_REPLICAS:-120} $TORCHRUN -m occult_hf.cli bench ep --shapes qwen1.5-moe-a2.7b olmoe-1b-7b $EP_SIZE \
    --tokens $REPLICA_TOKENS --iterations 5 --trace "$TRACE" --dispatchers all_to_all \
    --modes dedup+refined dedup+replicated dedup+replicated+load_aware --out $R/replicas > $OUT/replicas.txt 2>&1
  echo "rc=$?"; grep -v "$F" $OUT/replicas.txt | tail -20
}

{
date -u; [ -n "$DRY" ] || nvidia-smi -L; git log -1 --format="commit %h %s" 2>/dev/null | cut -c1-120
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
echo "STEPS=$STEPS TOKENS=$TOKENS DISPATCHERS=$DISPATCHERS MODES=$MODES REALSIZE=$REALSIZE EP_EXTRA=$EP_EXTRA MODEL_EXTRA=$MODEL_EXTRA T_TOTAL=$T_TOTAL DRY=$DRY"
for s in $STEPS; do
  echo "=== $s ($(left) s left)"; "step_$s"; date -u
done
} > $OUT/log.txt 2>&1
# tables.md: every table as written, the model's two halves as one table, then the targets they decide
python3 - "$R" "$OUT/tables.md" <<'EOF' >> $OUT/log.txt 2>&1
import json, sys
from pathlib import Path

r, out = Path(sys.argv[1]), Path(sys.argv[2])
parts, rows = [], {}
models = sorted(r.glob("model*/bench_model_*.md"))
if models:
    texts = [m.read_text().strip().split("\n") for m in models]
    parts.append("\n".join(texts[0] + [line for t in texts[1:] for line in t if line.startswith("| ") and not line.startswith("| shape")]))
    for m in sorted(r.glob("model*/bench_model_*.json")):
        for row in json.loads(m.read_text())["rows"]:
            rows.setdefault(row["shape"], {})[row["implementation"]] = row
for name, label in (("bench_realsize_*.md", ""), ("bench_ep_*.md", ""), ("replicas/bench_ep_*.md", "Replicas (issue 14), all_to_all:\n\n")):
    parts += [label + p.read_text().strip() for p in sorted(r.glob(name))]
targets = []
for shape, pair in rows.items():
    for name in (n for n in pair if n != "stock" and "stock" in pair):
        f = pair["stock"]["fwd_ms"] / pair[name]["fwd_ms"]
        b = pair["stock"]["fwd_bwd_ms"] / pair[name]["fwd_bwd_ms"]
        met = "yes" if min(f, b) >= 1.4 else "no"
        targets.append(f"- 4-layer model, {shape}, one GPU: {name} is {f:.2f}x (fwd) / {b:.2f}x (fwd+bwd) stock transformers (target 1.4x: {met})")
for p in sorted(r.glob("bench_realsize_*.json")):
    real = json.loads(p.read_text())["rows"]
    replica = [x for x in real if x["setup"].startswith("stock")]
    for x in real:
        if replica and x["setup"].startswith("occult"):
            f, b = x["fwd_ms"] / replica[0]["fwd_ms"], x["fwd_bwd_ms"] / replica[0]["fwd_bwd_ms"]
            met = "yes" if max(f, b) < 1 else "no"
            targets.append(f"- real size, {x['setup']}: {f:.2f}x (fwd) / {b:.2f}x (fwd+bwd) the replica's time, "
                           f"{x['peak_gib']:.1f} vs {replica[0]['peak_gib']:.1f} GiB (EP faster: {met}); decode {x['decode_ms_per_token']:.2f} ms/token")
if targets:
    parts.append("Targets (issue 10) from these tables:\n\n" + "\n".join(targets))
out.write_text("\n\n".join(parts) + "\n")
EOF
# few files come back (8): the steps' logs and the raw results in one archive
(cd $OUT && mv -t $R exact.txt model0.txt model1.txt realsize.txt ep.txt replicas.txt row_sum_check.txt 2>/dev/null; tar czf raw.tar.gz -C $R .)
rm -rf "$WORK"
cat $OUT/tables.md; tail -30 $OUT/log.txt
