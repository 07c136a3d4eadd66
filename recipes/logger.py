"""Experiment logging: W&B (offline by default) or nothing.

The W&B run gets the resolved config plus the Hydra choices, the loss curve, and the summary with
``/`` keys (``mem/peak_allocated_gib``, ``perf/tokens_per_s``, ``ledger/core_attn_bytes``...). The run
always finishes, even when logging fails, so one bad point does not break the next.
"""

from __future__ import annotations

import os
from typing import Any

from recipes.results import summary


def run_metrics(result: dict) -> dict[str, Any]:
    """The flat ``/``-keyed summary of a run (worst rank) for W&B."""
    row = summary(result)
    metrics = {
        "status": row["status"],
        "mem/peak_allocated_gib": row.get("peak_allocated_gib"),
        "mem/peak_reserved_gib": row.get("peak_reserved_gib"),
        "mem/fragmentation_gib": row.get("fragmentation_gib"),
        "mem/activation_gib": row.get("activation_gib"),
        "perf/step_time_s": row.get("step_time_s"),
        "perf/tokens_per_s": row.get("tokens_per_s"),
        "perf/mfu": row.get("mfu"),
        "ledger/total_bytes": row.get("ledger_bytes"),
    }
    ranks = result.get("ranks") or []
    worst = next((r for r in ranks if r.get("rank") == result.get("worst_rank")), None)
    if worst:
        for kind, b in ((worst.get("ledger") or {}).get("bytes_by_kind") or {}).items():
            metrics[f"ledger/{kind}_bytes"] = b
        for label, counts in (worst.get("checkpoints") or {}).items():
            metrics[f"ckpt/{label}_forward"] = counts["forward"]
            metrics[f"ckpt/{label}_recompute"] = counts["recompute"]
    for r in ranks:
        mem = r.get("memory") or {}
        if mem:
            metrics[f"rank{r['rank']}/mem/peak_allocated_gib"] = mem.get("peak_allocated_gib")
            metrics[f"rank{r['rank']}/mem/peak_reserved_gib"] = mem.get("peak_reserved_gib")
    return {k: v for k, v in metrics.items() if v is not None}


def log_run(cfg: dict, result: dict) -> None:
    """Log one finished run to the configured logger (no-op for logger=none)."""
    log = cfg["logger"]
    if log["name"] != "wandb":
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    run = wandb.init(
        project=log["project"],
        entity=log["entity"],
        mode=log["mode"],
        group=log["group"] or os.path.basename(os.path.dirname(result["run_dir"])),
        name=result["name"],
        tags=list(log["tags"]),
        dir=result["run_dir"],
        config={**cfg, "choices": result.get("choices", {})},
        reinit="finish_previous",
    )
    try:
        worst = next((r for r in result.get("ranks", []) if r.get("rank") == result.get("worst_rank")), {})
        for step, loss in enumerate(worst.get("loss") or []):
            if loss is not None:
                run.log({"train/loss": loss}, step=step)
        for key, value in run_metrics(result).items():
            run.summary[key] = value
    finally:
        run.finish()
