#!/usr/bin/env bash
# The GPU runs behind docs/: run on the H200 machine (offline, torch from its image, our
# dependencies from the carried wheelhouse), one or more named steps per call:
#   bash benchmarks/gpu_suite.sh sweeps attention bench
# Everything lands under results/ (tarred into $OUT/results.tgz when $OUT is set).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ! python3 -c "import megatron.core" 2>/dev/null; then
  eval "$(bash .whl/install-wheelhouse.sh .whl)"
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
PY=${PY:-python3}
SIZE=${SIZE:-h200}
FAMILIES=${FAMILIES:-"standard_attn mla moe gdn"}  # split across calls: one call has 10 minutes
# What docs/h200-results.md ran with (4 timed steps, profiling off); empty for the full defaults.
SWEEP_ARGS=${SWEEP_ARGS-"profile=none train.train_iters=6 train.warmup_iters=2"}
mkdir -p results
stamp() { echo "== $(date -u +%FT%TZ) $*"; }

step_env() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; $PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"; }
step_sweeps() {  # issue 3/4: every family's label table at the FACTS.md shape (sdpa)
  for s in $FAMILIES; do stamp "sweep=$s"; $PY train.py -m sweep=$s size=$SIZE $SWEEP_ARGS hydra.sweep.dir=results/sweep_$s 2>&1 | grep -v "Warning\|warn(" | tail -14; done; }
step_attention() {  # issue 2: {unfused, sdpa} x {none, control, core_attn, full} per family
  for m in $FAMILIES; do stamp "attention x $m"; $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS attention=unfused,sdpa recompute=none,control,selective/core_attn,full hydra.sweep.dir=results/attention_$m 2>&1 | grep -v "Warning\|warn(" | tail -12; done; }
step_mfu() {  # issue 7: MFU and recompute overhead per family, FACTS shape and the realistic size
  for z in h200 h200_long; do stamp "bench_mfu size=$z"; $PY benchmarks/bench_mfu.py --size $z --families standard_attn,mla,moe --out results/mfu_$z 2>&1 | tail -12; done; }
step_bench() { stamp bench_entrypoint; $PY benchmarks/bench_entrypoint.py size=$SIZE attention=sdpa recompute=none 2>&1 | tail -5;
  stamp bench_experts; $PY benchmarks/bench_experts.py 2>&1 | tail -12; }
step_oom() {  # issue 4: a forced OOM inside a sweep; the sweep goes on
  stamp oom; $PY train.py -m size=$SIZE attention=unfused measure.memory_fraction=0.2 recompute=none,selective/core_attn,full hydra.sweep.dir=results/oom 2>&1 | grep -v "Warning\|warn(" | tail -8; }
step_profile() { stamp profile; $PY benchmarks/profile_selftest.py --size h200 --runs families --out results/profile 2>&1 | tail -20; }

for s in "$@"; do "step_$s"; done
stamp done
for d in results/*/; do [ -f "$d/report.md" ] || $PY -m recipes.report "$d" >/dev/null 2>&1; done
[ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" results
