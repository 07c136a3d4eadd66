#!/usr/bin/env bash
# The one-GPU measurements behind docs/evidence/ (h200, speed-h200, offload-h200, profile). Run it on a
# machine with one H200 after `make install`, naming the steps to run, each optionally followed by the
# families it covers, and last `pack:<name>` to keep what they measured:
#   bash benchmarks/gpu_suite.sh sweeps:standard_attn,mla,moe labels:gdn long pack:h200
# Each step writes its sweeps, with their reports, under results/ (git-ignored). `pack:<name>` packs the
# sweep directories this call wrote into docs/evidence/<name>.jsonl.gz (the command, date, GPU and
# versions on top; tools/evidence.py) and regenerates docs/evidence/<name>.md; the header of each
# evidence file names the steps behind it. The whole list takes about 45 minutes.
# Settings (environment): PY (default .venv/bin/python, else python3), SIZE (h200), LONG_SIZE
# (h200_long), ATTENTION (the attention step's backends), SWEEP_ARGS (the settings of every point).
# The tables committed before the speed defaults (fused SwiGLU on a GPU, 4 micro-batches per step at the
# h200 sizes, the local MoE dispatcher) ran with SWEEP_ARGS="$SWEEP_ARGS $OLD_DEFAULTS"; the defaults step
# measures both.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
export TRITON_CACHE_AUTOTUNING=1  # fla's autotuned GDN kernels: tune once per machine, not per point
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
SIZE=${SIZE:-h200}
LONG_SIZE=${LONG_SIZE:-h200_long}
ATTENTION=${ATTENTION:-unfused,sdpa}  # the attention step's backends (sdpa rows also come from sweeps)
# What the committed tables ran with (4 timed steps, profiling off); empty for the full defaults.
SWEEP_ARGS=${SWEEP_ARGS-"profile=none train.train_iters=6 measure.start_step=3"}
OLD_DEFAULTS="model.bias_activation_fusion=false train.global_batch_size=null model.moe_token_dispatcher_type=allgather"
mkdir -p results
STARTED=$(mktemp); trap 'rm -f "$STARTED"' EXIT  # pack: the sweep directories written after this
stamp() { echo "== $(date -u +%FT%TZ) $*"; }
quiet() { grep -v "Warning\|warn(\|warnings.warn" | tail -"$1"; }

step_env() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"; }
step_sweeps() {  # each family's label table at the h200 size (sdpa)
  for s in ${1//,/ }; do stamp "sweep=$s"; $PY train.py -m sweep=$s size=$SIZE $SWEEP_ARGS \
    hydra.sweep.dir=results/sweep_$s 2>&1 | quiet 14; done; }
step_attention() {  # {unfused, sdpa} x {none, control, core_attn, full} per family
  for m in ${1//,/ }; do stamp "attention=$ATTENTION x $m"; $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS \
    attention=$ATTENTION recompute=none,control,selective/core_attn,full \
    hydra.sweep.dir=results/attention_$m 2>&1 | quiet 12; done; }
step_attention_unfused() { ATTENTION=unfused step_attention "$1"; }  # families whose sdpa rows a sweep ran
step_facts() {  # the comparison with a plain training loop: fused bias-SwiGLU, and unfused attention with fp32 softmax
  stamp "fused bias-SwiGLU"; $PY train.py -m model=standard_attn size=$SIZE $SWEEP_ARGS \
    model.bias_activation_fusion=true recompute=none,selective/mlp hydra.sweep.dir=results/facts_fusion 2>&1 | quiet 8
  stamp "unfused attention, fp32 softmax"; $PY train.py -m model=standard_attn size=$SIZE $SWEEP_ARGS attention=unfused \
    model.attention_softmax_in_fp32=true recompute=none hydra.sweep.dir=results/facts_fp32 2>&1 | quiet 6; }
step_long() {  # a family sweep at the realistic size (none does not fit: a real OOM), timed end to end
  for s in ${1:-standard_attn}; do stamp "sweep=$s size=$LONG_SIZE"; local t0=$SECONDS
    $PY train.py -m sweep=$s size=$LONG_SIZE $SWEEP_ARGS hydra.sweep.dir=results/long_$s 2>&1 | quiet 14
    echo "sweep=$s size=$LONG_SIZE: $((SECONDS - t0)) s end to end, report included"; done; }
step_confirm() {  # at the realistic size: the full/block that --predict once offered for 139 GiB, next to mlp
  stamp "confirm size=$LONG_SIZE"
  $PY train.py -m model=standard_attn size=$LONG_SIZE $SWEEP_ARGS recompute=full/block \
    recompute.recompute_num_layers=5 hydra.sweep.dir=results/confirm_long 2>&1 | quiet 6
  $PY train.py -m model=standard_attn size=$LONG_SIZE $SWEEP_ARGS recompute=selective/mlp \
    hydra.sweep.dir=results/confirm_long 2>&1 | quiet 6; }
step_bench() {  # entrypoint against a bare loop, and the bare loop's kernel time by kind
  for m in ${1//,/ }; do stamp "bench_entrypoint model=$m"; $PY benchmarks/bench_entrypoint.py model=$m size=$SIZE \
    attention=sdpa recompute=none --kernels --compile-rope 2>&1 | grep -v "Warning\|warn(" | tail -34; done; }
step_mfu() {  # what lifts MFU without TE: megatron's fused SwiGLU, and 4 micro-batches per step
  # (dense: the 2x2 grid, then fused with 8 micro-batches; other families: fused, 1 and 4 micro-batches)
  for m in ${1//,/ }; do stamp "mfu model=$m"; local fuse=true; [ "$m" = standard_attn ] && fuse=false,true
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none model.bias_activation_fusion=$fuse \
    train.global_batch_size=2,8 hydra.sweep.dir=results/mfu_$m 2>&1 | quiet 8
    if [ "$m" = standard_attn ]; then $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none \
      model.bias_activation_fusion=true train.global_batch_size=16 hydra.sweep.dir=results/mfu_${m}_gbs16 2>&1 | quiet 4; fi
  done; }
step_mfu_table() {  # MFU per family, from the label sweeps and the realistic size (run sweeps, gdn and long first)
  local dirs; dirs=$(ls -d results/sweep_* results/long_standard_attn 2>/dev/null)
  [ -n "$dirs" ] || { echo "no results/sweep_* yet: run the sweeps step first" >&2; return 1; }
  $PY benchmarks/bench_mfu.py --results $dirs; }
. benchmarks/triton_path.sh  # triton_path: a PYTHONPATH with Triton >= 3.7.1 for the GDN steps
step_gdn() {  # the GDN label table, with Triton >= 3.7.1 for this step only
  local pp; pp=$(triton_path) || return
  PYTHONPATH=$pp $PY -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  stamp "fla kernel against its reference"; PYTHONPATH=$pp $PY -m pytest -q -p no:cacheprovider \
    tests/test_gdn.py -k gpu 2>&1 | tail -6
  stamp "sweep=gdn"; PYTHONPATH=$pp $PY train.py -m sweep=gdn size=$SIZE $SWEEP_ARGS \
    hydra.sweep.dir=results/sweep_gdn 2>&1 | quiet 14; }
step_labels() {  # the labels the family sweeps leave out, so every (family, label) pair has a GPU row
  for m in ${1//,/ }; do stamp "labels model=$m"; local extra="" pp=${PYTHONPATH:-}
    if [ "$m" = gdn ]; then pp=$(triton_path) || continue; fi
    case $m in mla|gdn) extra=",selective/layernorm,selective/mlp";; moe) extra=",selective/layernorm,selective/moe-layernorm";; esac
    [ -n "$extra" ] && PYTHONPATH=$pp $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=control$extra \
      hydra.sweep.dir=results/labels_$m 2>&1 | quiet 8
    PYTHONPATH=$pp $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=full/block recompute.recompute_num_layers=4 \
      hydra.sweep.dir=results/labels_$m 2>&1 | quiet 4
    if [ "$m" = moe ]; then PYTHONPATH=$pp $PY train.py -m model=moe size=$SIZE $SWEEP_ARGS model.moe_shared_expert_intermediate_size=2048 \
      recompute=control,selective/shared_experts hydra.sweep.dir=results/labels_moe_shared 2>&1 | quiet 6; fi
  done; }
step_repeats() {  # labels' time costs against the spread between processes; the repetition varies
  # slowest, so each round times every label once, side by side
  for m in ${1//,/ }; do stamp "repeats model=$m"; local r=none,control,selective/core_attn
    case $m in moe) r=none,control,selective/moe_act;; mla) r=none,control,selective/mla_up_proj;; esac
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS measure.repeat=0,1,2 recompute=$r \
      hydra.sweep.dir=results/repeats_$m 2>&1 | quiet 10; done; }
step_entry() {  # entrypoint against the bare loop over 4 alternating pairs of fresh processes
  for m in ${1//,/ }; do stamp "bench_entrypoint --repeats 4 model=$m"; $PY benchmarks/bench_entrypoint.py model=$m \
    size=$SIZE attention=sdpa recompute=none --repeats 4 2>&1 | grep -v "Warning\|warn(" | tail -9; done; }
step_defaults() {  # the speed defaults against the settings the committed tables ran with, recompute=none,
  # three processes each (MoE's step time moves by up to 13% between processes); MoE: also the dispatcher alone
  for m in ${1//,/ }; do stamp "defaults model=$m"
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=0,1,2 $OLD_DEFAULTS \
      hydra.sweep.dir=results/defaults_$m 2>&1 | quiet 4
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=0,1,2 \
      hydra.sweep.dir=results/defaults_$m 2>&1 | quiet 8
    if [ "$m" = moe ]; then $PY train.py -m model=moe size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=0,1,2 \
      model.moe_token_dispatcher_type=allgather,local hydra.sweep.dir=results/dispatch_moe 2>&1 | quiet 8; fi
  done; }
step_wgrad() {  # megatron's gradient-accumulation fusion (recipes/build/wgrad.py) off and on, recompute=none,
  # alternating in fresh processes: 2 each (MoE: 3, its step moves between processes)
  for m in ${1//,/ }; do stamp "wgrad model=$m"; local r=0,1; [ "$m" = moe ] && r=0,1,2
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=$r \
      model.gradient_accumulation_fusion=false,true hydra.sweep.dir=results/wgrad_$m 2>&1 | quiet 6; done; }
step_gc() {  # train.manual_gc (recipes/run/collector.py) off and on, recompute=none, alternating in fresh
  # processes: 6 each for MoE (its spread between processes is what it addresses), 2 each otherwise; then
  # MoE's label sweep with it on, 3 processes a point
  for m in ${1//,/ }; do stamp "gc model=$m"; local r=0,1; [ "$m" = moe ] && r=0,1,2,3,4,5
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=$r \
      train.manual_gc=false,true hydra.sweep.dir=results/gc_$m 2>&1 | quiet 6
    [ "$m" = moe ] && $PY train.py -m sweep=moe size=$SIZE $SWEEP_ARGS measure.repeat=0,1,2 train.manual_gc=true \
      hydra.sweep.dir=results/gc_labels_moe 2>&1 | quiet 8; done; return 0; }
step_rope() {  # the fused RoPE (recipes/build/rope.py): model.apply_rope_fusion=false and null (auto: fused)
  # alternating in fresh processes, recompute=none: 3 each for MoE, 1 each otherwise; dense also selective/mlp
  # and full fused (their ratios to none)
  for m in ${1//,/ }; do stamp "rope model=$m"; local r=0; [ "$m" = moe ] && r=0,1,2
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=$r \
      model.apply_rope_fusion=false,null hydra.sweep.dir=results/rope_$m 2>&1 | quiet 6
    [ "$m" = standard_attn ] && $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=selective/mlp,full \
      hydra.sweep.dir=results/rope_recompute_$m 2>&1 | quiet 6; done; return 0; }
step_speed() {  # step speed at the defaults: dense none/mlp/full; MoE none and moe_act in 3 processes each, none
  # in 4 more free and 4 pinned to cores 0-3; MLA none twice; the 6-point sweep's seconds per point, forked and not
  stamp speed
  $PY train.py -m model=standard_attn size=$SIZE $SWEEP_ARGS recompute=none,selective/mlp,full \
    hydra.sweep.dir=results/speed_standard_attn 2>&1 | quiet 6
  $PY train.py -m model=moe size=$SIZE $SWEEP_ARGS recompute=none,selective/moe_act measure.repeat=0,1,2 \
    hydra.sweep.dir=results/speed_moe 2>&1 | quiet 6
  $PY train.py -m model=moe size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=0,1,2,3 \
    hydra.sweep.dir=results/speed_moe_free 2>&1 | quiet 4
  taskset -c 0-3 $PY train.py -m model=moe size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=0,1,2,3 \
    hydra.sweep.dir=results/speed_moe_pinned 2>&1 | quiet 4
  $PY train.py -m model=mla size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=0,1 \
    hydra.sweep.dir=results/speed_mla 2>&1 | quiet 4
  $PY benchmarks/bench_points.py size=$SIZE --repeats 1 2>&1 | tail -6; }
step_peer() {  # Megatron-LM's pretrain_gpt.py side by side (MEGATRON_LM: benchmarks/extract_megatron_lm.sh's output)
  [ -n "${MEGATRON_LM:-}" ] || { echo "set MEGATRON_LM to a Megatron-LM directory (bash benchmarks/extract_megatron_lm.sh" \
    "<Megatron-LM git dir> core_r0.19.0 /tmp/megatron-lm)" >&2; return 1; }
  stamp "bench_peer"; $PY benchmarks/bench_peer.py --megatron-lm "$MEGATRON_LM" --repeats 2 --iters 8 model=standard_attn \
    size=$SIZE attention=unfused recompute=none 2>&1 | grep -v "Warning\|warn(" | tail -32; }
step_pinning() {  # MoE none unpinned, pinned to 1 core and to 4 cores per rank, alternating, 4 processes each
  stamp "pinning"; $PY train.py -m model=moe size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=0,1,2,3 \
    launcher.cpu_cores_per_rank=null,1,4 hydra.sweep.dir=results/moe_pinning 2>&1 | quiet 6; }
step_compile() {  # torch.compile and megatron's CUDA graphs against eager, each variant in its own process
  local models=${1:-moe,standard_attn}; for m in ${models//,/ }; do stamp "bench_compile model=$m"
    $PY benchmarks/bench_compile.py model=$m size=$SIZE 2>&1 | grep -v "Warning\|warn(" | tail -14; done; }
step_gdn_speed() {  # GDN at the defaults, recompute=none, 2 processes (Triton >= 3.7.1; the first step autotunes)
  local pp; pp=$(triton_path) || return
  stamp "gdn none"; PYTHONPATH=$pp $PY train.py -m model=gdn size=$SIZE $SWEEP_ARGS recompute=none measure.repeat=0,1 \
    hydra.sweep.dir=results/speed_gdn 2>&1 | quiet 6; }
step_oom() {  # a forced OOM inside a sweep (a memory fraction); the sweep goes on
  stamp oom; $PY train.py -m size=$SIZE attention=unfused measure.memory_fraction=0.2 \
    recompute=none,selective/core_attn,full hydra.sweep.dir=results/oom 2>&1 | quiet 8; }
step_profile() { stamp profile; $PY benchmarks/profile_selftest.py --size $SIZE --runs families --out results/profile 2>&1 | tail -20; }

step_offload() {  # what each activation-offload option saves and costs, per family (fresh process a point): at
  # SIZE none, the guide's label and every offload option that applies; at LONG_SIZE (where none does not fit)
  # the planner's pick and runner-up for 137 GiB and the recompute option it is measured against
  local fams=${1:-standard_attn,moe,mla}; for m in ${fams//,/ }; do
    local label=selective/core_attn long=selective/mlp; [ "$m" = moe ] && label=selective/moe_act long=selective/moe_act
    local opts; opts=$($PY -c "from recipes.offload import options_for; print(','.join(o for o in options_for('$m') if o != 'none'))")
    stamp "offload model=$m size=$SIZE"; $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none,$label \
      hydra.sweep.dir=results/offload_${m}_$SIZE 2>&1 | quiet 6
    $PY train.py -m model=$m size=$SIZE $SWEEP_ARGS recompute=none offload=$opts \
      hydra.sweep.dir=results/offload_${m}_$SIZE 2>&1 | quiet 12
    [ "$m" = mla ] && continue
    local dir=results/offload_${m}_$LONG_SIZE; mkdir -p $dir
    $PY -m recipes advise --budget-gib 137 --predict model=$m size=$LONG_SIZE --json > $dir/plan.json || continue
    mapfile -t picks < <($PY -c "import json, sys
from recipes.analyze.plan import overrides_of
p = json.load(open(sys.argv[1]))['plan']
for row in (p['choice'], p['runner_up']):
    print(overrides_of(row) if row else '')" $dir/plan.json)
    $PY train.py -m model=$m size=$LONG_SIZE $SWEEP_ARGS recompute=$long hydra.sweep.dir=$dir 2>&1 | quiet 4
    for pick in "${picks[@]}"; do [ -n "$pick" ] || continue; stamp "offload model=$m size=$LONG_SIZE: $pick"
      $PY train.py -m model=$m size=$LONG_SIZE $SWEEP_ARGS $pick hydra.sweep.dir=$dir 2>&1 | quiet 4; done
  done; }
step_pack() {  # pack:NAME (last): the sweep directories this call wrote -> docs/evidence/NAME.jsonl.gz and NAME.md
  local name=${1:-h200} sweeps; sweeps=$(find results -mindepth 1 -maxdepth 1 -type d -newer "$STARTED" -printf '%f\n' | sort)
  [ -n "$sweeps" ] || { echo "pack: no sweep directory written by this call" >&2; return 1; }
  for d in $sweeps; do [ -f "results/$d/multirun.yaml" ] && [ ! -f "results/$d/report.md" ] && $PY -m recipes report "results/$d" >/dev/null 2>&1; done
  $PY tools/evidence.py pack "$name" results --sweeps $sweeps --date "$(date -u +%F)" \
    --gpu "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)" \
    --versions "$($PY -c "import sys, torch, megatron.core as m; print('Python', sys.version.split()[0], 'torch', torch.__version__, 'megatron-core', m.__version__)")" \
    --command "bash benchmarks/gpu_suite.sh $CALL" --command "SWEEP_ARGS=\"$SWEEP_ARGS\""; }

CALL="$*"
[ $# -gt 0 ] || { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; echo "steps: $(declare -F | sed -n 's/.* step_//p' | tr '\n' ' ')"; exit 2; }
failed=()
for s in "$@"; do
  declare -F "step_${s%%:*}" >/dev/null || { echo "unknown step ${s%%:*}" >&2; failed+=("$s"); continue; }
  stamp "step $s"; "step_${s%%:*}" $( [[ $s == *:* ]] && echo "${s#*:}" ) || failed+=("$s")
done
for d in results/*/; do  # a report for every sweep directory that has none yet
  [ -f "$d/multirun.yaml" ] && [ ! -f "$d/report.md" ] && $PY -m recipes report "$d" >/dev/null 2>&1
done
stamp done
[ ${#failed[@]} -eq 0 ] || { echo "failed steps: ${failed[*]}" >&2; exit 1; }
