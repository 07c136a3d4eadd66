#!/usr/bin/env bash
# The GPU runs behind docs/: run on the H200 machine (offline, torch from its image, our
# dependencies from the carried wheelhouse), one or more named steps, each optionally with the
# families it covers after a colon:
#   bash benchmarks/gpu_suite.sh env sweeps:mla,moe attention:standard_attn,mla bench long
# Everything lands under results/ (tarred into $OUT/results.tgz when $OUT is set). A queue longer
# than one device call (10 minutes) runs in the background under benchmarks/gpu_poll.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ! python3 -c "import megatron.core" 2>/dev/null; then
  eval "$(bash .whl/install-wheelhouse.sh .whl)"
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
export TRITON_CACHE_AUTOTUNING=1  # fla's autotuned GDN kernels: tune once per machine, not per point
PY=${PY:-python3}
SIZE=${SIZE:-h200}
LONG_SIZE=${LONG_SIZE:-h200_long}
ATTENTION=${ATTENTION:-unfused,sdpa}  # the attention step's backends (sdpa rows also come from sweeps)
# What docs/h200-results.md ran with (4 timed steps, profiling off); empty for the full defaults.
SWEEP_ARGS=${SWEEP_ARGS-"profile=none train.train_iters=6 train.warmup_iters=2"}
mkdir -p results
stamp() { echo "== $(date -u +%FT%TZ) $*"; }
quiet() { grep -v "Warning\|warn(\|warnings.warn" | tail -"$1"; }

step_env() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"; }
step_sweeps() {  # issues 3/4/11: each family's label table at the FACTS.md shape (sdpa)
  for s in ${1//,/ }; do stamp "sweep=$s"; $PY train.py -m sweep=$s size=$SIZE $SWEEP_ARGS \
    hydra.sweep.dir=results/sweep_$s 2>&1 | quiet 14; done; }
step_attention() {  # issue 2: {unfused, sdpa} x {none, control, core_attn, full} per family
  for m in ${1//,/ }; do stamp "attention=$ATTENTION x $m"; $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS \
    attention=$ATTENTION recompute=none,control,selective/core_attn,full \
    hydra.sweep.dir=results/attention_$m 2>&1 | quiet 12; done; }
step_attention_unfused() { ATTENTION=unfused step_attention "$1"; }  # families whose sdpa rows a sweep ran
step_facts() {  # issue 2's FACTS.md comparison: fused bias-SwiGLU, and unfused attention with fp32 softmax
  stamp "facts: bias_activation_fusion"; $PY train.py -m model=standard_attn size=$SIZE $SWEEP_ARGS \
    model.bias_activation_fusion=true recompute=none,selective/mlp hydra.sweep.dir=results/facts_fusion 2>&1 | quiet 8
  stamp "facts: unfused fp32 softmax"; $PY train.py -m model=standard_attn size=$SIZE $SWEEP_ARGS attention=unfused \
    model.attention_softmax_in_fp32=true recompute=none hydra.sweep.dir=results/facts_fp32 2>&1 | quiet 6; }
step_long() {  # issues 4/5/7: a family sweep at the realistic size (none does not fit: a real OOM), timed
  for s in ${1:-standard_attn}; do stamp "sweep=$s size=$LONG_SIZE"; local t0=$SECONDS
    $PY train.py -m sweep=$s size=$LONG_SIZE $SWEEP_ARGS hydra.sweep.dir=results/long_$s 2>&1 | quiet 14
    echo "sweep=$s size=$LONG_SIZE: $((SECONDS - t0)) s end to end, report included"; done; }
step_bench() {  # issues 2/7: entrypoint against a bare loop, and the bare loop's kernel time by kind
  for m in ${1//,/ }; do stamp "bench_entrypoint model=$m"; $PY benchmarks/bench_entrypoint.py model=$m size=$SIZE \
    attention=sdpa recompute=none --kernels --compile-rope 2>&1 | grep -v "Warning\|warn(" | tail -34; done; }
step_mfu() {  # issue 7: what lifts MFU without TE: megatron's fused SwiGLU, and 4 micro-batches per step
  # (dense: the 2x2 grid; other families: fused, 1 and 4 micro-batches, next to their sweep's none point)
  for m in ${1//,/ }; do stamp "mfu model=$m"; local fuse=true; [ "$m" = standard_attn ] && fuse=false,true
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none model.bias_activation_fusion=$fuse \
    train.global_batch_size=2,8 hydra.sweep.dir=results/mfu_$m 2>&1 | quiet 8; done; }
triton_site() {  # fla needs Triton >= 3.7.1 on Hopper (fla #640); the image has 3.6. A later call carries
  # .triton/ (benchmarks/pack_triton.sh) and touches results/triton.ready; wait for it, unpack, print the path.
  local t0=$SECONDS; while [ ! -f results/triton.ready ] && [ $((SECONDS - t0)) -lt 900 ]; do sleep 5; done
  [ -f results/triton.ready ] || { echo "no Triton 3.7.1 arrived: GDN skipped" >&2; return 1; }
  [ -d /tmp/triton-site/triton ] || { mkdir -p /tmp/triton-site &&
    tar -C /tmp/triton-site -xJf .triton/triton-3.7.1-stripped.tar.xz; } || return 1
  echo /tmp/triton-site${PYTHONPATH:+:$PYTHONPATH}; }
step_gdn() {  # issue 11: the GDN label table, on Triton 3.7.1 for this step only
  local pp; pp=$(triton_site) || return
  PYTHONPATH=$pp $PY -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  stamp "fla kernel against its reference"; PYTHONPATH=$pp $PY -m pytest -q -p no:cacheprovider \
    tests/test_gdn.py -k gpu 2>&1 | tail -6
  stamp "sweep=gdn"; PYTHONPATH=$pp $PY train.py -m sweep=gdn size=$SIZE $SWEEP_ARGS \
    hydra.sweep.dir=results/sweep_gdn 2>&1 | quiet 14; }
step_labels() {  # issue 3: the labels the family sweeps leave out, so every (family, label) pair has a GPU row
  for m in ${1//,/ }; do stamp "labels model=$m"; local extra="" pp=${PYTHONPATH:-}
    if [ "$m" = gdn ]; then pp=$(triton_site) || continue; fi
    case $m in mla|gdn) extra=",selective/layernorm,selective/mlp";; moe) extra=",selective/layernorm,selective/moe-layernorm";; esac
    [ -n "$extra" ] && PYTHONPATH=$pp $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=control$extra \
      hydra.sweep.dir=results/labels_$m 2>&1 | quiet 8
    PYTHONPATH=$pp $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=full/block recompute.recompute_num_layers=4 \
      hydra.sweep.dir=results/labels_$m 2>&1 | quiet 4
    [ "$m" = moe ] && PYTHONPATH=$pp $PY train.py -m model=moe size=$SIZE $SWEEP_ARGS model.moe_shared_expert_intermediate_size=2048 \
      recompute=control,selective/shared_experts hydra.sweep.dir=results/labels_moe_shared 2>&1 | quiet 6
  done; }
step_repeats() {  # issue 3: labels' time costs resolved against the spread between processes; the
  # repetition varies slowest, so each round times every label once, side by side
  for m in ${1//,/ }; do stamp "repeats model=$m"; local r=none,control,selective/core_attn
    case $m in moe) r=none,control,selective/moe_act;; mla) r=none,control,selective/mla_up_proj;; esac
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS measure.repeat=0,1,2 recompute=$r \
      hydra.sweep.dir=results/repeats_$m 2>&1 | quiet 10; done; }
step_entry() {  # issue 2: entrypoint against the bare loop over 4 alternating pairs of fresh processes
  for m in ${1//,/ }; do stamp "bench_entrypoint --repeats 4 model=$m"; $PY benchmarks/bench_entrypoint.py model=$m \
    size=$SIZE attention=sdpa recompute=none --repeats 4 2>&1 | grep -v "Warning\|warn(" | tail -9; done; }
step_experts() { stamp bench_experts; $PY benchmarks/bench_experts.py 2>&1 | tail -12; }
step_oom() {  # a forced OOM inside a sweep (a memory fraction); the sweep goes on
  stamp oom; $PY train.py -m size=$SIZE attention=unfused measure.memory_fraction=0.2 \
    recompute=none,selective/core_attn,full hydra.sweep.dir=results/oom 2>&1 | quiet 8; }
step_profile() { stamp profile; $PY benchmarks/profile_selftest.py --size $SIZE --runs families --out results/profile 2>&1 | tail -20; }

for s in "$@"; do stamp "step $s"; "step_${s%%:*}" $( [[ $s == *:* ]] && echo "${s#*:}" ); done
stamp done
for d in results/*/; do [ -f "$d/report.md" ] || $PY -m recipes.report "$d" >/dev/null 2>&1; done
[ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" results
exit 0
