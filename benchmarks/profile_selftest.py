"""GPU self-test of the peak attribution (recipes/measure/profile.py): one GPU, a few minutes at most.

    python benchmarks/profile_selftest.py [--out DIR] [--size small|h200] [--runs checks|families]

Runs the worker's measurement loop in this process (``train_and_measure`` with profile=peak) and
prints each run's peak attribution. ``--runs checks`` (default): a dense model with unfused
attention under ``recompute=control`` and ``selective/core_attn``, MLA and MoE under the control.
``--runs families``: per family, the control, then the label ``first_label_to_try`` picks from the
control's peak (the docs' runs: ``--size h200 --runs families``). Checks, per run:

- the attribution (the blocks alive at the replayed peak) sums to ``max_memory_allocated`` of the
  profiled step within 2%, and the replay lost no free event (history did not overflow);
- the profiled step's ``max_memory_allocated`` is within 1% of a normal step's (the recording
  does not change the peak it measures);
- switching to core_attn removes (almost all) core-attention bytes from the peak.

Writes each run's ``memory_timeline.png`` and ``result.json`` under ``--out`` (default
``results/profile``) and ``timelines.png`` (all runs side by side). Exits non-zero on a failed check.
On a CPU it runs the tiny shape and checks only what a CPU can (the ledger equality).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from recipes.config import compose_config  # noqa: E402  (after the repo is on sys.path)

CONF = str(Path(__file__).resolve().parent.parent / "conf")
#: A shape that takes seconds on an H200 yet has real activation tensors (MiB, not KiB).
SMALL = ["model.num_layers=4", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
         "model.num_attention_heads=16", "model.num_query_groups=null", "model.vocab_size=32768",
         "model.moe_ffn_hidden_size=1024", "model.q_lora_rank=384", "model.kv_lora_rank=256",
         "model.qk_head_dim=64", "model.qk_pos_emb_head_dim=32", "model.v_head_dim=64",
         "train.seq_length=2048", "train.micro_batch_size=2"]
CHECKS = [  # (name, overrides)
    ("dense unfused control", ["model=standard_attn", "attention=unfused", "recompute=control"]),
    ("dense unfused core_attn", ["model=standard_attn", "attention=unfused", "recompute=selective/core_attn"]),
    ("mla sdpa control", ["model=mla", "attention=sdpa", "recompute=control"]),
    ("moe sdpa control", ["model=moe", "attention=sdpa", "recompute=control"]),
]
#: --runs families: each family's control, then the advisor's first label (MoE last: in one process
#: a MoE trainer's memory is not all returned after it is dropped, and would count in the next run).
FAMILIES = [("dense unfused", ["model=standard_attn", "attention=unfused"]),
            ("mla sdpa", ["model=mla", "attention=sdpa"]), ("moe sdpa", ["model=moe", "attention=sdpa"])]
#: The guide's architecture default, run when the advisor says recompute is not the lever.


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/profile")
    parser.add_argument("--size", default="small", choices=["small", "h200"])
    parser.add_argument("--runs", default="checks", choices=["checks", "families"])
    parser.add_argument("--only", default="", help="run only the runs whose name contains this")
    args, extra = parser.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    shape = (SMALL if args.size == "small" else ["size=h200"]) if on_gpu else []
    common = shape + ["profile=peak", "train.train_iters=5", "measure.start_step=3"] + extra
    from recipes.run.worker import train_and_measure
    from recipes.run.world import init_one_rank, reseed

    init_one_rank(compose_config(common))
    from recipes.measure.timeline import first_label_to_try, plot_timelines, top_contributors, write_timeline_pngs
    from recipes.recompute import GUIDE_FIRST_LABEL

    failures, results = [], []
    queue = list(CHECKS) if args.runs == "checks" else [
        (f"{name} control", overrides + ["recompute=control"]) for name, overrides in FAMILIES]
    queue = [(n, o) for n, o in queue if args.only in n]
    while queue:
        name, overrides = queue.pop(0)
        cfg = compose_config(common + overrides)
        run_dir = out / name.replace(" ", "_").replace("/", ".")
        run_dir.mkdir(parents=True, exist_ok=True)
        reseed(cfg)
        rank: dict = {"rank": 0}
        train_and_measure(cfg, rank, run_dir)  # the trainer is dropped: one model at a time
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        result = {"name": name, "config": cfg, "choices": {"recompute": overrides[-1].split("=")[1]},
                  "status": rank.get("status"), "worst_rank": 0, "ranks": [rank]}
        write_timeline_pngs(result, run_dir)
        (run_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
        results.append(result)
        label, why = first_label_to_try(result)
        if args.runs == "families" and name.endswith(" control"):
            follow = label or GUIDE_FIRST_LABEL[cfg["model"]["family"]]  # shown either way, for comparison
            queue.insert(0, (name.replace("control", follow), overrides[:-1] + [f"recompute={follow}"]))
        prof = rank.get("profile") or {}
        if prof.get("status") != "ok":
            failures.append(f"{name}: profile {prof.get('status')}: {prof.get('error')}")
            continue
        print(f"== {name}: {top_contributors(result)}")
        print("   by kind (MiB):", {k: round(v / 2**20, 1) for k, v in prof["bytes_by_kind"].items() if v})
        print("   alive by phase of allocation (MiB):", {k: round(v / 2**20, 1) for k, v in prof["alive_by_phase"].items()})
        print(f"   first label to try: {label}: {why}")
        print("   cost:", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in prof["cost"].items()})
        if on_gpu:
            check = prof["check"]
            print("   check:", {k: (round(v, 5) if isinstance(v, float) else v) for k, v in check.items()})
            if not check["sum_within_2pct"]:
                failures.append(f"{name}: attribution sums to {check['sum_ratio']:.4f} x max_memory_allocated")
            if not prof["cost"].get("peak_change_within_1pct"):
                failures.append(f"{name}: profiling changed the peak by {prof['cost'].get('peak_change')}")
        else:
            ledger = rank["ledger"]["bytes_by_kind"]
            if prof["ledger_bytes_by_kind"] != ledger:
                failures.append(f"{name}: profiled ledger {prof['ledger_bytes_by_kind']} != ledger {ledger}")
    by_name = {r["name"]: r for r in results}
    control, core = by_name.get("dense unfused control"), by_name.get("dense unfused core_attn")
    if control and core and all(r["ranks"][0].get("profile", {}).get("status") == "ok" for r in (control, core)):
        before = control["ranks"][0]["profile"]["bytes_by_kind"]["core_attn"]
        after = core["ranks"][0]["profile"]["bytes_by_kind"]["core_attn"]
        print(f"core_attn bytes at the peak: control {before / 2**20:.1f} MiB -> core_attn {after / 2**20:.1f} MiB")
        if not after < 0.5 * before:
            failures.append("selective/core_attn did not remove core-attention bytes from the peak")
    plot_timelines(results, out / "timelines.png")
    print(f"timelines: {out / 'timelines.png'}")
    for f in failures:
        print("FAIL:", f)
    print("OK" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
