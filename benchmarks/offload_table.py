"""The table benchmarks/gpu_offload.sh ends with: recompute against activation offload, measured.

One row per point of the sweep directories given (their ``result.json``), grouped by model and size:
peak allocated, what the point copied to the host (the ledger's host bytes of one micro-batch after
megatron's plan; bytes moved per measured step), step time and its change against the group's
``none`` point (or, where ``none`` did not fit, its fastest completed point), the copy time the
profiled step measured on the copy streams and the part of it no compute kernel overlapped (exposed),
and the host link's bandwidth.

    python benchmarks/offload_table.py results/offload_standard_attn_h200 results/offload_moe_h200 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: import the repository's recipes

from recipes.analyze.plan import price_config  # noqa: E402
from recipes.config import upgrade  # noqa: E402
from recipes.offload import option_of as offload_option  # noqa: E402
from recipes.recompute import option_of as recompute_option  # noqa: E402

GIB = 2**30
HEADER = ("| model | size | point | status | peak alloc GiB | host GiB (per micro-batch) | moved GiB per step | "
          "step ms | vs none | copies ms | exposed ms | link GB/s (D2H / H2D) | predicted added ms |")


def load(dirs: list[str]) -> list[dict]:
    """Every result.json under the directories, with the plan's prediction if the script saved one: its
    row for the point's options, or, where the plan priced them at another offload fraction or block
    layer count than the point ran, the point's own config priced at the plan's rates."""
    out = []
    for d in dirs:
        predicted, rates = {}, None
        plan = Path(d) / "plan.json"
        if plan.exists():
            saved = json.loads(plan.read_text())["plan"]
            predicted = {(r["recompute"], r["offload"]): r for r in saved["rows"]}
            rates = saved["tflops"], saved["host_link_gb_s"]
        for path in sorted(Path(d).glob("*/result.json")):
            result = json.loads(path.read_text())
            cfg = upgrade(result.get("config") or {})
            recompute, offload = recompute_option(cfg), offload_option(cfg)
            result["_plan"] = (recompute, offload)
            row = predicted.get((recompute, offload))
            if row and not _same_settings(row, cfg):
                row = price_config(cfg, *rates)
            result["_predicted"] = row
            out.append(result)
    return out


def _same_settings(row: dict, cfg: dict) -> bool:
    """Whether a plan row priced the offload fraction and block layer count the point ran with."""
    fraction = cfg["offload"]["activation_offload_fraction"] if row["offload"] != "none" else 1.0
    layers = row.get("recompute_num_layers")
    return (row.get("activation_offload_fraction", 1.0) == fraction
            and (layers is None or layers == cfg["recompute"].get("recompute_num_layers")))


def _worst(result: dict) -> dict:
    ranks = result.get("ranks") or [{}]
    return next((r for r in ranks if r.get("rank") == result.get("worst_rank")), ranks[0])


def row(result: dict) -> dict:
    rank = _worst(result)
    mem, timing, ledger = rank.get("memory") or {}, rank.get("timing") or {}, rank.get("ledger") or {}
    off = rank.get("offload") or {}
    transfer, link = off.get("transfer") or {}, off.get("link") or {}
    moved = (off.get("moved_per_step") or {}).get("d2h_bytes")
    ch = result.get("choices") or {}
    recompute, offload = result["_plan"]
    predicted = result.get("_predicted")
    return {"model": ch.get("model"), "size": ch.get("size"), "status": result.get("status"),
            "point": f"recompute={recompute}" + (f" offload={offload}" if offload != "none" else ""),
            "offload": offload, "recompute": recompute,
            "peak": mem.get("peak_allocated_gib"), "host": ledger.get("host_total_bytes"), "moved": moved,
            "step_ms": timing["step_time_s"] * 1e3 if timing.get("step_time_s") else None,
            "copy_ms": transfer["copy_busy_s"] * 1e3 if transfer.get("copy_busy_s") is not None else None,
            "exposed_ms": transfer["exposed_s"] * 1e3 if transfer.get("exposed_s") is not None else None,
            "link": (link["d2h_gb_s"], link["h2d_gb_s"]) if link.get("d2h_gb_s") else None,
            "predicted_ms": predicted["cost_s"] * 1e3 if predicted else None}


def _f(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(results: list[dict]) -> str:
    rows = [row(r) for r in results]
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["size"]), []).append(r)
    for (model, size), group in groups.items():
        done = [r for r in group if r["step_ms"] is not None]
        base = next((r for r in done if r["recompute"] == "none" and r["offload"] == "none"), None)
        base = base or min(done, key=lambda r: r["step_ms"], default=None)
        for r in sorted(group, key=lambda r: (r["offload"] != "none", r["recompute"] != "none", r["point"])):
            vs = (f"{(r['step_ms'] / base['step_ms'] - 1) * 100:+.1f}%" + ("" if base["point"] == "recompute=none"
                  else f" (vs {base['point']})") if r["step_ms"] and base and r is not base else
                  ("reference" if r is base else "-"))
            link = f"{r['link'][0]:.1f} / {r['link'][1]:.1f}" if r["link"] else "-"
            lines.append(f"| {model} | {size} | {r['point']} | {r['status']} | {_f(r['peak'], '{:.2f}')} | "
                         f"{_f(r['host'] / GIB if r['host'] is not None else None, '{:.2f}')} | "
                         f"{_f(r['moved'] / GIB if r['moved'] is not None else None, '{:.2f}')} | "
                         f"{_f(r['step_ms'], '{:.1f}')} | {vs} | {_f(r['copy_ms'], '{:.1f}')} | "
                         f"{_f(r['exposed_ms'], '{:.1f}')} | {link} | {_f(r['predicted_ms'], '{:.1f}')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    results = load(argv)
    if not results:
        print("no result.json under " + " ".join(argv), file=sys.stderr)
        return 1
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
