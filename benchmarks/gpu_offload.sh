#!/usr/bin/env bash
# Activation offload against recompute on one H200 (docs/offload.md). After `make install`:
#   bash benchmarks/gpu_offload.sh
# For dense (model=standard_attn) and MoE: at the h200 size none, the guide's first label, the offload
# options (five dense, four MoE; OFFLOAD_ALL=1: every one that applies) and the planner's pick and
# runner-up for a budget below none's peak; at h200_long (where none does not fit) the planner's pick
# and runner-up for the H200's 137 GiB. At most 21 points, planned for about 8 minutes on one H200
# (each point is a fresh process: about 20 s at h200, 30-40 s at h200_long; a plan that repeats an
# offload point reuses it). Writes results/offload_<model>_<size>/ (sweeps, each
# with the planner's plan.json) and results/offload/table.md: peak allocated, host bytes, step time
# against none, the copies' time and the part compute did not hide (exposed), the host link.
# Settings (environment): PY, SIZES (h200 h200_long), MODELS (standard_attn moe; mla runs too), OFFLOAD_ALL,
# OFFLOAD_standard_attn / OFFLOAD_moe (the offload options to run, comma-separated),
# BUDGET_standard_attn / BUDGET_moe / BUDGET_mla (GiB for the h200 plan; 19 / 25 / 17), LONG_BUDGET (137), EXTRA (overrides
# for every plan and point, e.g. train.global_batch_size=null: one micro-batch per step, a quarter of the time),
# LONG_standard_attn / LONG_moe (recompute options measured beside the plan at h200_long; mlp / moe_act).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
SIZES=${SIZES:-h200 h200_long}
MODELS=${MODELS:-standard_attn moe}
BUDGET_standard_attn=${BUDGET_standard_attn:-19}  # none peaks at 18.4 GiB (20.0 with the slack): needs recompute or offload
BUDGET_moe=${BUDGET_moe:-25}                        # none 24.2 GiB, over with the allocator's slack
BUDGET_mla=${BUDGET_mla:-17}                        # MODELS=mla: none 17.6 GiB (measured 2026-12-05)
LONG_BUDGET=${LONG_BUDGET:-137}                     # what PyTorch may reserve on an H200
EXTRA=${EXTRA:-}
ARGS="profile=none train.train_iters=6 measure.start_step=3 $EXTRA"
LONG_standard_attn=${LONG_standard_attn-selective/mlp}
LONG_moe=${LONG_moe-selective/moe_act}
mkdir -p results/offload
stamp() { echo "== $(date -u +%FT%TZ) $*"; }
quiet() { grep -v "Warning\|warn(\|warnings.warn\|Activation Offload Summary\|^Rank\|^Total\|^=\+$\|^-\+$" | tail -"$1"; }

guide_label() { case $1 in moe) echo selective/moe_act;; *) echo selective/core_attn;; esac; }
offload_options() {  # the offload options to run at the h200 size for a model (OFFLOAD_<model>: your list)
  local own=OFFLOAD_$1
  if [ -n "${!own:-}" ]; then echo "${!own}"
  elif [ -n "${OFFLOAD_ALL:-}" ]; then
    $PY -c "from recipes.offload import options_for; print(','.join(o for o in options_for('$1') if o != 'none'))"
  elif [ "$1" = moe ]; then echo expert_fc1,moe_act,expert_fc1-moe_act,core_attn-attn_proj
  else echo attn_norm-mlp_norm,qkv_linear,core_attn,core_attn-attn_proj,qkv_linear-core_attn-attn_proj; fi; }
plan() {  # model size budget dir: the planner's pick and runner-up, one line of overrides each
  $PY -m recipes advise --budget-gib "$3" --predict model=$1 size=$2 $EXTRA --json > "$4/plan.json" || return 1
  $PY -c "import json, sys
from recipes.analyze.plan import overrides_of
p = json.load(open(sys.argv[1]))['plan']
for row in (p['choice'], p['runner_up']):
    print(overrides_of(row) if row else '')" "$4/plan.json"; }
run() { local dir=$1; shift; $PY train.py -m "$@" $ARGS hydra.sweep.dir=$dir 2>&1 | quiet 4; }

t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
for size in $SIZES; do
  for m in $MODELS; do
    dir=results/offload_${m}_${size}; mkdir -p $dir
    if [ "$size" = h200_long ]; then budget=$LONG_BUDGET; else budget_var=BUDGET_$m; budget=${!budget_var}; fi
    stamp "$m size=$size: plan for $budget GiB"
    mapfile -t picks < <(plan $m $size $budget $dir)
    printf '   plan: %s\n   runner-up: %s\n' "${picks[0]:-none fits}" "${picks[1]:-}"
    if [ "$size" != h200_long ]; then
      stamp "$m size=$size: none, $(guide_label $m)"; run $dir model=$m size=$size recompute=none,$(guide_label $m)
      stamp "$m size=$size: offload"; run $dir model=$m size=$size recompute=none offload=$(offload_options $m)
    fi
    long_var=LONG_$m
    if [ "$size" = h200_long ] && [ -n "${!long_var:-}" ]; then
      stamp "$m size=$size: recompute=${!long_var}"; run $dir model=$m size=$size recompute=${!long_var}
    fi
    for pick in "${picks[@]}"; do
      [ -n "$pick" ] || continue
      stamp "$m size=$size: $pick"; run $dir model=$m size=$size $pick
    done
  done
done
stamp "table"
$PY benchmarks/offload_table.py results/offload_*_h200 results/offload_*_h200_long 2>/dev/null | tee results/offload/table.md
echo "$((SECONDS - t0)) s end to end"
