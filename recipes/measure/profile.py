"""What drives the peak: one profiled training step, its memory timeline and the peak's attribution.

The guide's first decision depends on "the tensor that actually drives the per-rank peak".
``profile_step`` runs one extra training step after the timed ones (``profile=peak``, the default;
``profile=none`` turns it off) and records, for this rank, the bytes alive at the peak by module
kind (the ledger's kinds), ``parameters``, ``gradients``, ``optimizer_state`` and
``other/transient``, and the phase the peak falls in (forward of layer i, backward of layer j,
optimizer step). ``recipes.measure.memtrace`` records the step's ``Trace``; ``replay`` here walks it:

- GPU: the caching allocator's events for this one step. The peak is the sum of the blocks alive at
  the peak event, so the attribution adds up to the allocator's peak by construction (the check
  against ``max_memory_allocated`` is recorded: trace sizes are requested sizes, rounded here to the
  allocator's 512 bytes). Normal steps run without the recording.
- CPU: the storages saved for backward, gradients and optimizer state, so CI tests the logic. At
  the end of a micro-batch's forward the CPU attribution equals the ledger.

Also here: the timeline plots (``plot_timeline``, ``plot_timelines``) and the console and advisor
helpers (``top_contributors``, ``first_label_to_try``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from recipes.build import compat
from recipes.config import typed
from recipes.errors import ConfigError
from recipes.measure.memtrace import BEFORE, BUCKETS, STATIC, TRANSIENT, Trace, record_cpu, record_gpu
from recipes.recompute import KINDS, LABELS
from recipes.results import load_result

MODES = ("none", "peak")


# --- replay: the peak, what is alive there, and the timeline -------------------------------------


def _attribute(trace: Trace, sizes: dict[int, int]) -> dict:
    by_bucket = {b: 0 for b in BUCKETS}
    by_phase: dict[str, int] = {}
    by_layer: dict[str, int] = {}
    for blk, n in sizes.items():
        bucket, origin = trace.bucket[blk], trace.origin[blk]
        by_bucket[bucket] += n
        by_phase[origin] = by_phase.get(origin, 0) + n
        if bucket in KINDS and " layer " in origin:
            layer = origin.rsplit(" ", 1)[-1]
            by_layer[layer] = by_layer.get(layer, 0) + n
    top_phases = dict(sorted(by_phase.items(), key=lambda kv: -kv[1])[:8])
    return {"bytes_by_kind": by_bucket, "alive_by_phase": top_phases, "activation_bytes_by_layer": by_layer}


def replay(trace: Trace, num_samples: int = 400) -> dict:
    """Walk the events: the peak (the first event reaching the maximum), what is alive there and at
    the end of the first forward, and a down-sampled stacked timeline for plots."""
    sizes, total, totals = dict(trace.start), sum(trace.start.values()), []
    totals.append(total)
    for blk, n, _ in trace.events:
        if blk >= 0:
            total += n - sizes.get(blk, 0)
            sizes[blk] = n
        totals.append(total)
    peak_i = max(range(len(totals)), key=totals.__getitem__)
    phases = [BEFORE] + [phase for _, _, phase in trace.events]  # phase after i events
    fwd_end = next((i - 1 for i in range(1, len(phases)) if phases[i].startswith("backward")), None)
    step = max(1, len(totals) // num_samples)
    samples = set(range(0, len(totals), step)) | {peak_i, len(totals) - 1}
    series: dict[str, list[int]] = {b: [] for b in BUCKETS}
    xs, marks = [], {}
    sizes, by_bucket = dict(trace.start), {b: 0 for b in BUCKETS}
    for blk, n in sizes.items():
        by_bucket[trace.bucket[blk]] += n

    def visit(i: int) -> None:
        if i in samples:
            xs.append(i)
            for b in BUCKETS:
                series[b].append(by_bucket[b])
        if i in (peak_i, fwd_end):
            marks[i] = {b: n for b, n in sizes.items() if n}

    visit(0)
    for i, (blk, n, _) in enumerate(trace.events, start=1):
        if blk >= 0:
            by_bucket[trace.bucket[blk]] += n - sizes.get(blk, 0)
            sizes[blk] = n
        visit(i)
    spans: list[list] = []
    for i, phase in enumerate(phases):
        if spans and spans[-1][2] == phase:
            spans[-1][1] = i
        else:
            spans.append([i, i, phase])
    out = {"peak_bytes": totals[peak_i], "peak_phase": phases[peak_i], "peak_event": peak_i,
           "num_events": len(trace.events), **_attribute(trace, marks[peak_i])}
    out["forward_end"] = None
    if fwd_end is not None:
        at_end = _attribute(trace, marks[fwd_end])["bytes_by_kind"]
        out["forward_end"] = {"event": fwd_end, "phase": phases[fwd_end],
                              "activation_bytes_by_kind": {k: at_end[k] for k in KINDS}}
    out["timeline"] = {"x": xs, "series": {b: v for b, v in series.items() if any(v)},
                       "phases": spans, "total": [sum(series[b][j] for b in BUCKETS) for j in range(len(xs))]}
    return out


# --- the profiled step ---------------------------------------------------------------------------


def _reference_step(trainer, on_gpu: bool) -> dict:
    """One normal step to compare against: its time and peak (GPU) or its ledger (CPU)."""
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.step(record_ledger=not on_gpu)
    if on_gpu:
        torch.cuda.synchronize()
        return {"step_s": time.perf_counter() - t0, "peak_bytes": torch.cuda.max_memory_allocated()}
    return {"step_s": time.perf_counter() - t0, "ledger": dict(trainer.ledger.bytes_by_kind)}


#: Why a CPU run writes no memory snapshot.
NO_CPU_SNAPSHOT = ("no memory snapshot on a CPU: PyTorch's viewer (memory_viz) reads the CUDA caching allocator's "
                   "history, and a CPU has no such allocator; the profile's timeline is the saved tensors'")


def snapshot_path(run_dir: Path | str) -> Path:
    """Where the profiled step's allocator snapshot goes: ``memory_snapshot.pickle`` (rank 0), else
    ``memory_snapshot_rank<N>.pickle``; drag it into https://pytorch.org/memory_viz."""
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    return Path(run_dir) / ("memory_snapshot.pickle" if rank == 0 else f"memory_snapshot_rank{rank}.pickle")


def profile_step(trainer, cfg: dict, run_dir: Path | None = None, step_time_s: float | None = None) -> dict:
    """Profile one extra training step (``measure.profile=peak``); returns the rank's ``profile``.

    Writes ``memory_timeline.png`` (rank 0; ``memory_timeline_rank<N>.png`` for others) into
    ``run_dir`` when given, and on a GPU the step's allocator snapshot (``snapshot_path``: for
    pytorch.org/memory_viz; ``profile["snapshot"]``; a CPU writes none, ``profile["snapshot_note"]``).
    ``step_time_s`` (the median of the timed steps) is the cost reference; without it, the reference
    step's time is used. A failure is recorded, never raised: the run's
    measurements stand without the profile.
    """
    cfg = typed(cfg)
    mode = cfg.measure.profile
    if mode not in MODES:
        raise ConfigError("measure.profile", f"unknown profile {mode!r}", "use profile=peak or profile=none")
    if mode == "none":
        return {}
    on_gpu = compat.cuda_available()
    try:
        ref = _reference_step(trainer, on_gpu)
        snapshot = snapshot_path(run_dir) if on_gpu and run_dir is not None else None
        trace, info = record_gpu(trainer, snapshot) if on_gpu else record_cpu(trainer)
        out = {"status": "ok", "source": "allocator" if on_gpu else "saved_tensors", **replay(trace)}
    except Exception as err:  # the run's own measurements are already in the result
        return {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    out["snapshot"] = str(snapshot) if on_gpu and snapshot is not None else None
    if not on_gpu:
        out["snapshot_note"] = NO_CPU_SNAPSHOT
    baseline = step_time_s or ref["step_s"]
    cost = {"profiled_step_s": info.pop("profiled_step_s"), "step_time_s": baseline,
            "reference_step_s": ref["step_s"]}
    cost["time_ratio"] = cost["profiled_step_s"] / baseline if baseline else None
    if on_gpu:  # the allocator's peak with and without the recording, and the replay's sum
        cost.update(reference_peak_bytes=ref["peak_bytes"], profiled_peak_bytes=info["max_memory_allocated_bytes"])
        out["check"] = {**info, "replay_peak_bytes": out["peak_bytes"],
                        "sum_ratio": out["peak_bytes"] / info["max_memory_allocated_bytes"]}
        out["check"]["sum_within_2pct"] = abs(out["check"]["sum_ratio"] - 1) <= 0.02 and not info["unmatched_frees"]
    else:  # the ledger's measure (first forward of each chunk), without and with the profiling hooks
        out["ledger_bytes_by_kind"] = info["ledger_bytes_by_kind"]
        cost.update(reference_peak_bytes=sum(ref["ledger"].values()),
                    profiled_peak_bytes=sum(info["ledger_bytes_by_kind"].values()))
    if cost.get("reference_peak_bytes"):
        cost["peak_change"] = cost["profiled_peak_bytes"] / cost["reference_peak_bytes"] - 1
        cost["peak_change_within_1pct"] = abs(cost["peak_change"]) <= 0.01
    out["cost"] = cost
    out["top"] = top_buckets(out)
    out["title"] = _run_title(cfg)
    return out


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


def _run_title(cfg: dict) -> str:
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
