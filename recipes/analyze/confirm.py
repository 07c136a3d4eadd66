"""Confirm closes the loop: a plan's top points (``DIR/plan.json``, ``recipes.analyze.frontier``) beside
what their sweep measured. Says whether the measured order (by step time) matched the predicted one,
which prediction missed by how much (peak and step time a point), which "fits" ran out of memory; it
refits nothing. A sweep run on another GPU than the plan's profile is refused: plan again for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from recipes.analyze.sweep import find_results, merge_repeats
from recipes.errors import ConfigError
from recipes.hardware import match_profile
from recipes.offload import option_of as offload_option_of
from recipes.recompute import option_of
from recipes.results import worst_row


def point_key(row: dict) -> tuple:
    """(recompute, block layers, offload, fraction, micro-batch) of a plan point."""
    return (row["recompute"], row.get("recompute_num_layers"), row.get("offload", "none"),
            row.get("activation_offload_fraction", 1.0), row["micro_batch_size"])


def result_key(cfg: dict) -> tuple:
    rc, off = cfg["recompute"], cfg["offload"]
    option = option_of(cfg)
    layers = rc.get("recompute_num_layers") if option == "full/block" else None
    return (option, layers, offload_option_of(cfg), off.get("activation_offload_fraction", 1.0),
            cfg["train"]["micro_batch_size"])


def same_gpu(device: str, profile_gpu: str) -> bool:
    """Whether a run's device is the GPU a plan's profile describes: the same name, or the same spec profile."""
    return device == profile_gpu or (match_profile(device) is not None and match_profile(device) == match_profile(profile_gpu))


def compare(sweep_dir: Path) -> dict | None:
    """The plan's points beside the sweep's measurements, or None where ``sweep_dir`` has no plan.json."""
    path = sweep_dir / "plan.json"
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    results = merge_repeats(find_results(sweep_dir))
    devices = {d for r in results for d in [r.get("device")] + [k.get("device") for k in r.get("ranks") or []]
               if d and d != "cpu"}
    wrong = sorted(d for d in devices if not same_gpu(d, plan["profile_gpu"]))
    if wrong:
        raise ConfigError("cluster.gpu", f"the plan in {path} was made for {plan['profile_gpu']} (profile "
                          f"{plan['profile']}) but its sweep ran on {', '.join(wrong)}",
                          "plan again for this GPU (its spec profile, or `python -m recipes calibrate --out "
                          "gpu.yaml` and cluster.gpu=gpu.yaml) and rerun the sweep into a new directory")
    by_key = {result_key(r["config"]): r for r in results if r.get("config")}
    rows = []
    for i, p in enumerate(plan["top"]):
        r = by_key.get(point_key(p))
        row = {"point": p["point"], "rank": i + 1, "predicted_peak_gib": p["predicted_peak_gib"],
               "predicted_step_s": p["step_s"], "status": r.get("status") if r else "not run"}
        if r and r.get("ranks"):
            w = worst_row(r)
            row.update(measured_peak_gib=w.peak_allocated_gib, measured_reserved_gib=w.peak_reserved_gib,
                       measured_step_s=w.step_time_s)
        rows.append(row)
    ran = [r for r in rows if r["status"] == "ok" and r.get("measured_step_s")]
    measured_order = [r["point"] for r in sorted(ran, key=lambda r: r["measured_step_s"])]
    predicted_order = [r["point"] for r in ran]
    return {"plan": str(path), "profile": plan["profile"], "devices": sorted(devices), "rows": rows,
            "order_matched": measured_order == predicted_order if len(ran) > 1 else None,
            "measured_order": measured_order, "predicted_order": predicted_order,
            "fits_failed": [r["point"] for r in rows if r["status"] == "oom"]}


def explain_confirm(c: dict | None) -> list[str]:
    if not c:
        return []
    lines = [f"Against the plan ({c['plan']}, profile {c['profile']}; ran on {', '.join(c['devices']) or 'no GPU'}):"]
    for r in c["rows"]:
        text = (f"  {r['point']} (predicted #{r['rank']}): {r['status']}; peak {r['predicted_peak_gib']:.2f} GiB "
                f"predicted")
        if r.get("measured_peak_gib") is not None:
            text += (f", {r['measured_peak_gib']:.2f} measured ({r['measured_peak_gib'] - r['predicted_peak_gib']:+.2f};"
                     f" {r['measured_reserved_gib'] or 0:.2f} reserved)")
        text += f"; step {r['predicted_step_s'] * 1e3:.0f} ms predicted"
        if r.get("measured_step_s"):
            miss = r["measured_step_s"] / r["predicted_step_s"] - 1
            text += f", {r['measured_step_s'] * 1e3:.0f} measured ({miss:+.0%})"
        lines.append(text)
    if c["order_matched"] is not None:
        lines.append(f"  measured order {' < '.join(c['measured_order'])}: "
                     + ("as predicted" if c["order_matched"] else f"NOT as predicted ({' < '.join(c['predicted_order'])})"))
    if c["fits_failed"]:
        lines.append(f"  predicted to fit but ran out of memory: {', '.join(c['fits_failed'])}")
    lines.append("  (nothing refitted: the profile and the estimator are unchanged)")
    return lines
