"""A profiled step's memory timeline, read without torch: the plots (``plot_timeline``,
``plot_timelines``, ``write_timeline_pngs``) and the console and advisor helpers (``top_buckets``,
``top_contributors``, ``first_label_to_try``). ``recipes.measure.profile`` records the profile; the
controller draws and prints it after its workers exit, and it must not import torch for that (2 CPU-s
a run on a 2-core machine)."""

from __future__ import annotations

from pathlib import Path

from recipes.config import typed
from recipes.recompute import KINDS, LABELS
from recipes.results import load_result

#: The buckets a profile attributes the peak to, in plot order (static memory at the bottom): the
#: static state, the ledger's kinds, the rest.
STATIC = ("parameters", "gradients", "optimizer_state")
TRANSIENT = "other/transient"
BUCKETS = STATIC + KINDS + (TRANSIENT,)


def write_timeline_pngs(result: dict, run_dir: Path | str) -> list[Path]:
    """Each profiled rank's timeline PNG (``memory_timeline.png`` for rank 0, else
    ``memory_timeline_rank<N>.png``). The controller draws them after the workers exit, so the
    worker neither imports matplotlib nor renders while it holds the GPU."""
    written = []
    for r in result.get("ranks") or []:
        prof = r.get("profile")
        if not prof or not prof.get("timeline"):
            continue
        rank = r.get("rank", 0)
        png = Path(run_dir) / ("memory_timeline.png" if rank == 0 else f"memory_timeline_rank{rank}.png")
        try:
            plot_timeline(prof, png, title=f"{prof.get('title', result.get('name', ''))} (rank {rank})")
            prof["png"] = str(png)
            written.append(png)
        except Exception as err:  # a plot never fails a run
            prof["png_error"] = f"{type(err).__name__}: {err}"
    return written


# --- plots ---------------------------------------------------------------------------------------


def run_title(cfg: dict) -> str:
    """The run's name, else its model, attention and recompute policy."""
    cfg = typed(cfg)
    if cfg.get("name"):
        return str(cfg.name)
    rc = cfg.recompute
    policy = rc.recompute_granularity or "none"
    if policy == "selective":
        policy = f"selective [{', '.join(rc.recompute_modules)}]"
    return f"{cfg.model.family}, {cfg.attention.backend} attention, recompute {policy}"


_COLORS = {"parameters": "#4d4d4d", "gradients": "#8c8c8c", "optimizer_state": "#bdbdbd",
           "embedding": "#8dd3c7", "norm": "#ffffb3", "attn_proj": "#bebada", "core_attn": "#fb8072",
           "gdn": "#bc80bd", "mlp": "#80b1d3", "moe": "#fdb462", "other": "#b3de69", "logits": "#fccde5",
           TRANSIENT: "#d9d9d9"}


def _human(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _draw(ax, prof: dict, title: str) -> None:
    tl = prof["timeline"]
    xs, scale = tl["x"], 2**30 if prof["peak_bytes"] >= 2**30 else 2**20
    names = [b for b in BUCKETS if b in tl["series"]]
    ax.stackplot(xs, *[[v / scale for v in tl["series"][b]] for b in names],
                 labels=names, colors=[_COLORS[b] for b in names], linewidth=0)
    shade = {"forward": "#e8f1fb", "backward": "#fdeee0", "optimizer": "#e6f5e6", "grad": "#e6f5e6"}
    spans = [[x0, x1 + 1, phase] for x0, x1, phase in tl["phases"]]  # event x1 ends where x1+1 starts
    for x0, x1, phase in spans:
        ax.axvspan(x0, x1, color=shade.get(phase.split(" ")[0], "white"), zorder=-2, linewidth=0)
        if phase.split(" ")[0] in ("forward", "backward") and "layer" in phase:
            ax.axvline(x0, color="#cccccc", linewidth=0.4, zorder=-1)
    for x0, x1, phase in [s for s in spans if s[1] - s[0] > 1] if len(spans) <= 60 else []:
        short = phase.replace("forward ", "F ").replace("backward ", "B ").replace("layer ", "L")
        ax.text((x0 + x1) / 2, 1.0, short, transform=ax.get_xaxis_transform(), fontsize=5,
                rotation=90, ha="center", va="bottom")
    peak_x, peak_y = prof["peak_event"], prof["peak_bytes"] / scale
    ax.plot([peak_x], [peak_y], "kv", markersize=5)
    text = f"peak {_human(prof['peak_bytes'])}\n{prof['peak_phase']}\n" + "\n".join(
        f"{t['name']} {t['fraction']:.0%}" for t in prof["top"])
    ax.annotate(text, (peak_x, peak_y), xytext=(0.98, 0.97), textcoords="axes fraction", fontsize=7,
                ha="right", va="top", bbox={"boxstyle": "round", "fc": "white", "alpha": 0.85},
                arrowprops={"arrowstyle": "->", "lw": 0.6})
    ax.set_title(title, fontsize=9, pad=44)
    ax.set_xlabel("allocator events (alloc/free)" if prof.get("source") == "allocator"
                  else "saved-tensor events (pack/free)", fontsize=8)
    ax.set_ylabel("GiB" if scale == 2**30 else "MiB", fontsize=8)
    ax.set_xlim(xs[0], xs[-1])
    ax.tick_params(labelsize=7)


def plot_timeline(prof: dict, path: Path | str, title: str = "") -> Path:
    """One rank's memory over the profiled step: stacked by bucket, phases shaded, peak annotated."""
    # lazy: only when plotting
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    _draw(ax, prof, title or "memory over one training step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return Path(path)


def _profile_of(result: dict) -> dict | None:
    """The profile of a run (its worst rank's), a rank result, or a profile itself."""
    if "timeline" in result and "bytes_by_kind" in result:
        return result
    if isinstance(result.get("profile"), dict):
        return result["profile"] if result["profile"].get("status") == "ok" else None
    ranks = [r for r in result.get("ranks") or [] if (r.get("profile") or {}).get("status") == "ok"]
    if not ranks:
        return None
    worst = [r for r in ranks if r.get("rank") == result.get("worst_rank")]
    return (worst or [max(ranks, key=lambda r: r["profile"]["peak_bytes"])])[0]["profile"]


def plot_timelines(runs: list, path: Path | str) -> Path | None:
    """Side by side (shared memory axis): each run's timeline, e.g. the control and each label.

    ``runs``: result dicts (``result.json`` contents) or run directories. Runs without a profile
    are skipped; returns None when none has one.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = []
    for run in runs:
        result = run if isinstance(run, dict) else load_result(Path(run))
        prof = _profile_of(result)
        if prof is not None:
            items.append((result.get("name") or result.get("choices", {}).get("recompute") or "run", prof))
    if not items:
        return None
    cols = min(3, len(items))
    rows = -(-len(items) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), sharey=True, squeeze=False)
    for ax, (name, prof) in zip(axes.flat, items):
        _draw(ax, prof, name)
    for ax in list(axes.flat)[len(items):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# --- console and advisor -------------------------------------------------------------------------


def top_buckets(prof: dict, n: int = 3) -> list[dict]:
    """The ``n`` largest buckets at the peak: name, bytes, fraction of the peak."""
    ranked = sorted(prof["bytes_by_kind"].items(), key=lambda kv: -kv[1])[:n]
    peak = prof["peak_bytes"] or 1
    return [{"name": k, "bytes": v, "fraction": v / peak} for k, v in ranked if v]


def top_contributors(result: dict) -> str:
    """One line for the run summary: the peak, its phase and its top three contributors ("" if none)."""
    prof = _profile_of(result)
    if prof is None:
        return ""
    tops = ", ".join(f"{t['name']} {t['fraction']:.0%} ({_human(t['bytes'])})" for t in top_buckets(prof))
    return f"peak {_human(prof['peak_bytes'])} in {prof['peak_phase']}: {tops}"


def first_label_to_try(result: dict) -> tuple[str | None, str]:
    """The guide's first recompute label for this run's peak, and why; (None, why) when recompute
    is not the lever. ``result`` is a run result (its ``config`` names the model family)."""
    prof = _profile_of(result)
    if prof is None:
        return None, "no peak attribution in this result: run with profile=peak"
    cfg = result.get("config") or {}
    family = (cfg.get("model") or {}).get("family") or (result.get("choices") or {}).get("model")
    backend = (cfg.get("attention") or {}).get("backend") or (result.get("choices") or {}).get("attention")
    b, peak = prof["bytes_by_kind"], prof["peak_bytes"] or 1
    static = sum(b.get(k, 0) for k in STATIC)
    acts = {k: b.get(k, 0) for k in KINDS}
    top = max(acts, key=acts.get)
    where = f"at the peak ({_human(prof['peak_bytes'])}, {prof['peak_phase']})"
    if static >= sum(acts.values()):
        return None, (f"parameters, gradients and optimizer state hold {static / peak:.0%} {where}, more than "
                      "activations: recompute cannot remove them; use more data parallelism with the "
                      "distributed optimizer (or tensor/pipeline parallelism), not recompute")
    share = f"{top} activations hold {acts[top] / peak:.0%} {where}"
    run = {"model": {**(cfg.get("model") or {}), "family": family}, "attention": {"backend": backend}}
    for name, label in LABELS.items():  # the first label whose advice answers this kind
        why = label.advice_for(run) if label.advice_kind == top else None
        if why is not None:
            return f"selective/{name}", f"{share}: {why}"
    if top == "attn_proj":
        return "full", f"{share}: no selective label discards standard attention projections' inputs"
    if top in ("logits", "embedding"):
        return None, (f"{share}: a recompute label will not help much; use a vocabulary-parallel loss "
                      "(tensor parallelism) or a smaller micro-batch")
    return "full", f"{share}: layer-level tensors outside the selective boundaries; full recompute covers them"
