#!/usr/bin/env bash
# The two-H200 runs behind docs/evidence/h200x2: every layout of docs/recipes.md that fits on two
# GPUs, per family, with recompute none / the guide's label / full, each rank measured. Run on one
# machine with two H200s and the project installed; name the steps to run (default: all, in order):
#   bash benchmarks/gpu_x2.sh env dense moe long_moe moe_repeat mla long_dense analyse pack
# Everything lands under results/: one sweep directory per step (results/x2_<step>/) and its console
# output next to it (results/x2_<step>.log). The estimator comparison, the report and the advisor
# read those directories afterwards (no GPU needed): the `analyse` step runs them. `pack` packs every
# results/x2_* sweep into docs/evidence/h200x2.jsonl.gz (tools/evidence.py) and regenerates its table.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
PY=${PY:-python3}
# What the single-GPU tables ran with (docs/evidence/h200): 2 warm-up + 4 timed steps, profiling off.
ARGS="profile=none train.train_iters=6 measure.start_step=3"
LONG_ARGS="profile=none train.train_iters=4 measure.start_step=2"
mkdir -p results
stamp() { echo "== $(date -u +%FT%TZ) $*"; }
sweep() {  # sweep NAME OVERRIDES...: one Hydra sweep into results/x2_NAME, console into results/x2_NAME.log
  local name=$1; shift; stamp "sweep x2_$name: $*"
  $PY train.py -m "$@" hydra.sweep.dir=results/x2_$name 2>&1 | grep -v "Warning\|warn(" | tee results/x2_$name.log | tail -40; }

step_env() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import sys, torch, megatron.core as m; print('python', sys.version.split()[0], 'torch', torch.__version__,
'megatron-core', m.__version__, 'gpus', torch.cuda.device_count())"
  $PY -c "import transformer_engine" 2>/dev/null && echo "transformer_engine present" || echo "no transformer_engine"; }
step_dense() { sweep standard_attn model=standard_attn size=h200 parallel=dp2,tp2,pp2,pp2_vpp2,tp2_nosp \
  recompute=none,selective/core_attn,full $ARGS; }
step_moe() { sweep moe model=moe size=h200 parallel=ep2,tp2 recompute=none,selective/moe_act,full $ARGS; }
step_moe_repeat() {  # MoE step times vary between processes: every point once more, in new processes
  sweep moe_repeat model=moe size=h200 parallel=ep2,tp2 recompute=none,selective/moe_act,full $ARGS measure.repeat=1; }
step_mla() { sweep mla model=mla size=h200 parallel=dp2,tp2,pp2 recompute=none,selective/mla_up_proj,full $ARGS; }
# The advisor's pick for the realistic size on two GPUs, next to its runner-up
# (python -m recipes advise --budget-gib 137 --predict model=<family> size=h200_long parallel=<layout>).
step_long_moe() { sweep long_moe model=moe size=h200_long parallel=ep2 \
  recompute=selective/layernorm,selective/moe_act $LONG_ARGS; }
step_long_dense() { sweep long_dense model=standard_attn size=h200_long parallel=tp2 recompute=none,control $LONG_ARGS; }

# A checkpoint saved under TP2 loaded under TP1: the TP1 run resumes from
# step 3 and trains steps 4-6; its losses are printed next to the TP2 run's for the same steps.
CK="size=h200 profile=none measure.start_step=2 train.train_iters=6 train.lr=1e-4 train.log_interval=1
  checkpoint=default checkpoint.interval=3 checkpoint.keep_last=2"
step_ckpt() { rm -rf results/ck_tp2 results/ck_tp1
  $PY train.py $CK parallel=tp2 output_dir=results/ck_tp2 2>&1 | grep -v "Warning\|warn(" | tee results/ck_tp2.log | tail -15
  $PY train.py $CK parallel=single checkpoint.resume=results/ck_tp2/checkpoints/step_00000003 \
    output_dir=results/ck_tp1 2>&1 | grep -v "Warning\|warn(" | tee results/ck_tp1.log | tail -15
  $PY - <<'PY'
import json
a, b = (json.load(open(f"results/ck_{t}/result.json")) for t in ("tp2", "tp1"))
la, lb = a["ranks"][0]["loss"], b["ranks"][0]["loss"]  # the TP1 run trained steps 4-6
print("step  loss at TP2 (straight)  loss at TP1 (resumed from TP2's step 3)")
for step, (x, y) in enumerate(zip(la[-len(lb):], lb), start=len(la) - len(lb) + 1):
    print(f"{step:>4}  {x:>24.6f}  {y:>40.6f}")
PY
  rm -rf results/ck_tp2/checkpoints results/ck_tp1/checkpoints; }

step_analyse() {  # no GPU: predicted next to measured per rank, the reports, the advisor's choices
  local q="Warning\|warn(\|absl"
  for d in results/x2_*/; do d=${d%/}; [ -f "$d/multirun.yaml" ] || continue
    $PY -m recipes estimate --compare "$d" 2>&1 | grep -v "$q" > "$d/compare.txt"
    $PY -m recipes report "$d" --no-wandb > /dev/null 2>&1; done
  # budgets that force a choice: dense 9 GiB (no layout fits without recompute; core_attn saves nothing
  # under SDPA), 12 GiB (dp2 and the pipelines do not fit without it); MoE 15 GiB (between tp2's none and moe_act)
  for b in 9 12; do [ -d results/x2_standard_attn ] && $PY -m recipes advise results/x2_standard_attn \
    --budget-gib $b 2>&1 | grep -v "$q" > results/x2_standard_attn/advise-${b}gib.txt; done
  [ -d results/x2_moe ] && $PY -m recipes advise results/x2_moe --budget-gib 15 2>&1 | grep -v "$q" \
    > results/x2_moe/advise-15gib.txt
  for d in results/x2_long_*/; do [ -d "$d" ] && $PY -m recipes advise "${d%/}" --budget-gib 137 2>&1 |
    grep -v "$q" > "${d%/}/advise-137gib.txt"; done
  for m in "model=standard_attn size=h200_long parallel=tp2" "model=moe size=h200_long parallel=ep2"; do
    echo "\$ python -m recipes advise --budget-gib 137 --predict $m"
    $PY -m recipes advise --budget-gib 137 --predict $m 2>&1 | grep -v "$q"; echo; done > results/x2_advise-predict.txt
  true; }

step_pack() {  # every results/x2_* sweep (and the TP2 -> TP1 checkpoint runs) -> docs/evidence/h200x2
  local sweeps files=() f; sweeps=$(cd results && ls -d x2_*/ 2>/dev/null | tr -d /)
  [ -n "$sweeps" ] || { echo "pack: no results/x2_* sweep yet" >&2; return 1; }
  for f in results/x2_advise-predict.txt results/ck_tp2/result.json results/ck_tp1/result.json; do [ -f $f ] && files+=($f); done
  $PY tools/evidence.py pack h200x2 results --sweeps $sweeps --text "${files[@]}" --date "$(date -u +%F)" \
    --gpu "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/1x /' | paste -sd, )" \
    --versions "$($PY -c "import sys, torch, megatron.core as m; print('Python', sys.version.split()[0], 'torch', torch.__version__, 'megatron-core', m.__version__)")" \
    --command "bash benchmarks/gpu_x2.sh $CALL"; }

[ $# -eq 0 ] && set -- env dense moe long_moe moe_repeat mla long_dense analyse pack
CALL="$*"
for s in "$@"; do stamp "step $s"; "step_$s"; done
stamp done
