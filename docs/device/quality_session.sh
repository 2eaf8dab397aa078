#!/bin/bash
# The whole quality study (issue 34) as ONE run on one H200 that outlives the device tool's 10-minute calls:
#   call 1:   bash docs/device/quality_session.sh start     carry [".devdata/pack", ".whl"]
#   call 2..: bash docs/device/quality_session.sh wait      issued as soon as the last returns (the machine stays held
#                                                           30 s after a call; a released machine ends the run, so
#                                                           nothing, no other tool call, goes between the calls)
# `start` copies what the run reads into $RUN (the checkout's scripts and package, the wheels, the data archive: the
# tool copies the checkout again at every call, under a running script), starts docs/quality_h200.sh in a process
# session of its own (setsid: the tool ends a call's other processes when the call returns) with its own OUT and WORK
# in $RUN, DEFAULT_KERNELS=1 and BUDGET (default 1500 s, the run's own deadline), then waits as `wait` does.
# `wait` prints the run's pipeline lines as they come, for WAIT seconds (default 560), and exits 3 while the run goes
# on (with a snapshot of the results so far, so_far.tar.gz); once the run has ended it copies the run's outputs
# (quality_results.json and the six archives and plots) and its log into $OUT and exits with the run's status (0: every
# variant done, 2: some left, 1: a failure).
# Env passed on to the run: BUDGET, DEFAULT_KERNELS (default 1; 0 for the repeatable base job), SIZE, DATA (with SIZE=micro
# a CPU check: NO_INSTALL=1 NO_MPS=1 DATA=... SIZE=micro OUT=/tmp/o bash docs/device/quality_session.sh start).
set -u
RUN=${RUN:-/tmp/quality_run}
WAIT=${WAIT:-560}
OUT=${OUT:?OUT: where the results go}
case "${1:-}" in
  start)
    if [ -e "$RUN" ]; then echo "a quality run was already started on this machine ($RUN): call wait"; exit 1; fi
    mkdir -p "$RUN/root/.devdata" && cp -r docs src kernels patches eval "$RUN/root/" || exit 1
    [ -d .whl ] && cp -r .whl "$RUN/root/"
    [ -d .devdata/pack ] && cp -r .devdata/pack "$RUN/root/.devdata/"
    [ "${DEFAULT_KERNELS:-1}" = 0 ] && unset DEFAULT_KERNELS || export DEFAULT_KERNELS=1
    (cd "$RUN/root" && OUT="$RUN/out" WORK="$RUN/work" BUDGET="${BUDGET:-1500}" setsid nohup \
      bash -c "bash docs/quality_h200.sh; echo \$? > '$RUN/status'" > "$RUN/log.txt" 2>&1 < /dev/null &)
    echo "quality run started in $RUN at $(date -u +%H:%M:%S)" ;;
  wait)
    if [ ! -d "$RUN" ]; then echo "no quality run on this machine (a fresh one?): call start"; exit 1; fi ;;
  *) echo "usage: bash docs/device/quality_session.sh start|wait"; exit 1 ;;
esac
shown=0
show() {  # the run's new log lines that say how it goes (the pipeline's, MPS, errors)
  local lines
  lines=$(wc -l < "$RUN/log.txt" 2>/dev/null || echo 0)
  [ "$lines" -gt "$shown" ] && sed -n "$((shown + 1)),${lines}p" "$RUN/log.txt" | grep -E '^\[pipeline\]|CUDA MPS|BUDGET|Error|error|Traceback'
  shown=$lines
}
end=$((SECONDS + WAIT))
while [ ! -f "$RUN/status" ] && [ $SECONDS -lt "$end" ]; do
  sleep 5
  show
done
show
if [ ! -f "$RUN/status" ]; then
  # what the run has so far (the variants' results, the base job's log, plans, tasks, logs; no weights), so that a
  # machine released before the run's end does not lose it all
  (cd "$RUN" && find work/variants work/base/train_log.json work/base/fingerprint.txt work/base.json work/base_kernels.txt \
    work/placement_d*.json work/tasks/tasks.json work/logs -maxdepth 1 -type f 2>/dev/null | tar czf "$OUT/so_far.tar.gz" -T -)
  cp "$RUN/log.txt" "$OUT/run_log_so_far.txt"
  echo "still running at $(date -u +%H:%M:%S): call wait again ($OUT/so_far.tar.gz: the results so far)"
  exit 3
fi
cp "$RUN"/out/* "$OUT"/ 2>/dev/null
cp "$RUN/log.txt" "$OUT/run_log.txt"
echo "the run ended with status $(cat "$RUN/status") at $(date -u +%H:%M:%S)"
exit "$(cat "$RUN/status")"
