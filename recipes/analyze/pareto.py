"""Peak memory against step time for a sweep's points: the memory axis, the Pareto front, the plot."""

from __future__ import annotations

from pathlib import Path


def point_rows(rows: list[dict]) -> list[dict]:
    """The rows that decide fit: each point's worst rank (or its only row)."""
    return [r for r in rows if r["worst"] or r["rank"] is None]


def memory_axis(rows: list[dict]) -> tuple[str, str]:
    """The memory a point is judged by: peak allocated (GPU), else the activation ledger (CPU)."""
    if any(r.get("peak_allocated_gib") is not None and r["status"] == "ok" for r in rows):
        return "peak_allocated_gib", "peak allocated GiB (worst rank)"
    return "ledger_mib", "activation ledger MiB (CPU run: no allocator peaks)"


def pareto_front(rows: list[dict], mem_key: str) -> list[dict]:
    """Points no other point beats on both memory and step time, fastest first."""
    pts = [r for r in rows if r["status"] == "ok" and r.get(mem_key) is not None and r.get("step_ms") is not None]
    front = [p for p in pts if not any(
        q[mem_key] <= p[mem_key] and q["step_ms"] <= p["step_ms"]
        and (q[mem_key] < p[mem_key] or q["step_ms"] < p["step_ms"]) for q in pts)]
    return sorted(front, key=lambda p: p["step_ms"])


def short_label(row: dict, rows: list[dict]) -> str:
    """The recompute choice, with model/attention added only when the sweep varies them."""
    parts = [row[k] for k in ("model", "attention") if len({r[k] for r in rows}) > 1]
    return " ".join(str(p) for p in parts + [row["recompute"] or row["point"]])


def plot_pareto(rows: list[dict], path: Path, title: str) -> Path:
    """Peak memory against step time for every measured point, Pareto frontier marked; ``path``."""
    # lazy: only when plotting
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = point_rows(rows)
    mem_key, mem_label = memory_axis(points)
    measured = [r for r in points
                if r["status"] == "ok" and r.get(mem_key) is not None and r.get("step_ms") is not None]
    front = pareto_front(points, mem_key)
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ax.scatter([r["step_ms"] for r in measured], [r[mem_key] for r in measured], s=36, color="0.55",
               zorder=2, label="measured point")
    ax.plot([r["step_ms"] for r in front], [r[mem_key] for r in front], "-o", color="tab:red", ms=8,
            drawstyle="steps-post", zorder=3, label="Pareto frontier (nothing is both faster and smaller)")
    for group in _near(measured, mem_key):  # one label per cluster: none and control often coincide
        ax.annotate("\n".join(short_label(r, points) for r in group), (group[0]["step_ms"], group[0][mem_key]),
                    textcoords="offset points", xytext=(6, 4), fontsize=8, va="bottom")
    lost = [f"{short_label(r, points)}: {r['status']}" for r in points if r not in measured]
    if lost:
        ax.text(0.99, 0.99, "not plotted\n" + "\n".join(lost), transform=ax.transAxes, ha="right",
                va="top", fontsize=7, color="tab:red", bbox={"fc": "white", "ec": "0.8"})
    ax.set_xlabel("step time ms (median of steady-state steps, worst rank)")
    ax.set_ylabel(mem_label)
    if mem_key == "ledger_mib":
        title += "\nledger = bytes saved for backward in one micro-batch (activations only)"
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.25, y=0.12)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _near(points: list[dict], mem_key: str, frac: float = 0.03) -> list[list[dict]]:
    """Points closer than ``frac`` of both axis spans, grouped (for one label per group)."""
    if not points:
        return []
    span = lambda k: (max(p[k] for p in points) - min(p[k] for p in points)) or 1.0  # noqa: E731
    dx, dy = span("step_ms") * frac, span(mem_key) * frac
    groups: list[list[dict]] = []
    for p in sorted(points, key=lambda p: (p["step_ms"], p[mem_key])):
        home = next((g for g in groups if abs(g[0]["step_ms"] - p["step_ms"]) <= dx
                     and abs(g[0][mem_key] - p[mem_key]) <= dy), None)
        home.append(p) if home is not None else groups.append([p])
    return groups
