#!/usr/bin/env bash
# A gpu_suite.sh queue longer than one device call (10 minutes): the first call starts the queue in
# its own process session, so it outlives the call while the machine stays held; every call (the
# first too) then waits up to SECONDS for it and tars what results/ holds so far into $OUT. Issue
# the next call within the machine's warm window (30 s) and it finds the queue still running.
#   bash benchmarks/gpu_poll.sh 540 env sweeps:mla,moe attention:standard_attn bench long
# results/ is git-ignored, so the device keeps it between calls.
cd "$(dirname "$0")/.."
wait_s=${1:?usage: gpu_poll.sh SECONDS [gpu_suite steps...]}; shift
mkdir -p results
if [ ! -f results/suite.pid ]; then
  env -u OUT setsid nohup bash benchmarks/gpu_suite.sh "$@" >results/suite.log 2>&1 </dev/null &
  echo $! >results/suite.pid
  echo "started: $*"
fi
pid=$(cat results/suite.pid)
end=$((SECONDS + wait_s))
while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 3; done
if kill -0 "$pid" 2>/dev/null; then echo "queue still running"; else echo "queue finished"; fi
grep -v "Warning\|warn(\|warnings.warn" results/suite.log | tail -150
[ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" results
exit 0
