"""What a run prints: one line per run (its worst rank), one per rank, findings, where the time went."""

from __future__ import annotations

from recipes.measure.timeline import top_contributors
from recipes.results import RankRow, result_rows, worst_row


def _numbers(row: RankRow) -> list[str]:
    """Memory, ledger and speed of one row, as the console shows them."""
    parts = []
    if row.peak_allocated_gib is not None:
        parts.append(f"peak alloc {row.peak_allocated_gib:.2f} GiB")
    if row.peak_reserved_gib is not None:
        parts.append(f"reserved {row.peak_reserved_gib:.2f} GiB")
    if row.ledger_mib is not None:
        parts.append(f"ledger {row.ledger_mib:.2f} MiB")
    if row.host_mib is not None:  # activation offload: what a micro-batch's forward copied to the host
        parts.append(f"host {row.host_mib:.2f} MiB")
    return parts


def print_run(result: dict) -> None:
    """A short console summary of one run: its worst rank, then every rank of a multi-rank run."""
    row = worst_row(result)
    status = row.point_status
    parts = [f"[{status}] {row.point}", *_numbers(row)]
    if row.step_ms is not None:
        parts.append(f"step {row.step_ms:.1f} ms")
    if row.gpu_ms is not None:  # measure.gpu_time: the step's GPU work, which the host's speed does not move
        parts.append(f"GPU busy {row.gpu_ms:.1f} ms")
    if row.host_wait_s is not None and (row.device or "cpu") != "cpu":  # near 0: a host-bound step
        parts.append(f"host waited {row.host_wait_s * 1e3:.1f} ms")
    if row.reload_wait_ms is not None:  # offload on a GPU: compute waiting for its tensors to come back
        parts.append(f"reload waits {row.reload_wait_ms:.1f} ms")
    if row.tokens_per_s is not None:
        parts.append(f"{row.tokens_per_s:.0f} tok/s")
    if row.mfu is not None:
        parts.append(f"MFU {row.mfu * 100:.1f}%")
    print(" | ".join(parts))
    rows = result_rows(result)
    if len(rows) > 1:  # every rank, by its parallel coordinates; the worst decides whether it fits
        hosts = len({r.host for r in rows}) > 1
        for r in rows:
            print(f"  {rank_line(r, hosts)}")
    if line := top_contributors(result):  # profile=peak: what drives the peak
        print(f"  {line}")
    for r in result.get("ranks") or []:  # runs with validation (data.eval_interval): the loss curve
        evals = [e for e in r.get("eval_loss") or [] if e.get("loss") is not None]
        train = [x for x in r.get("loss") or [] if x is not None]
        if evals and train:
            print(f"  train/loss {train[0]:.3f} -> {train[-1]:.3f} | val/loss "
                  + ", ".join(f"{e['loss']:.3f} (step {e['step']})" for e in evals))
            break
    if status in ("stopped", "preempted"):
        rank = (result.get("ranks") or [{}])[0]
        print(f"  {status} at step {rank.get('stopped_at')}: {(rank.get('checkpoint') or {}).get('path', 'no checkpoint')}"
              " (the same command resumes with checkpoint.resume=auto)")
    elif status != "ok":
        print(f"  error: {result.get('error')}")
    warnings = list(result.get("warnings", []))
    for r in result.get("ranks") or []:  # label findings are per rank (a label may run on some only)
        warnings += [w for w in r.get("warnings") or [] if w not in warnings]
    for warning in warnings:
        print(f"  warning: {warning}")
    phases = time_breakdown(result)
    if phases:
        print("  time: " + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()))


#: Worker timeline marks and the phase each one ends (recipes/run/worker.py), in their usual order.
_PHASES = [("main_start", "start+imports"), ("logger_ready", "W&B init"), ("megatron_imported", "megatron imports"),
           ("device_ready", "device init"), ("process_group_ready", "process group"),
           ("distributed_ready", "parallel state"), ("built", "build"),
           ("warmed_up", "first step"), ("steady_done", "to the window end"), ("modules_timed", "module times"),
           ("profile_done", "profile"), ("ledgers_done", "control ledgers"), ("trained", "training"),
           ("end", "findings+exit")]


def time_breakdown(result: dict) -> dict[str, float]:
    """Where a point's wall time went (rank 0's timeline from the launch): the fixed costs that
    decide how long a sweep takes, next to the timed steps that decide the comparison."""
    ranks = result.get("ranks") or []
    marks = dict((ranks[0].get("timeline") or {}) if ranks else {})
    launched = result.get("launched")
    if not marks or launched is None:
        return {}
    marks["end"] = launched + result.get("wall_s", 0.0)
    phases, previous = {}, launched
    for key, name in sorted((p for p in _PHASES if p[0] in marks), key=lambda p: marks[p[0]]):
        phases[name] = marks[key] - previous  # in the order they happened (module times move with offload)
        previous = marks[key]
    phases["wall"] = result.get("wall_s", 0.0)
    return phases


def rank_line(row: RankRow, host: bool = False) -> str:
    """One rank of a multi-rank run: coordinates, memory, ledger and what its schedule holds, time."""
    label = f"rank {row.rank}"
    if row.coords:
        label += " (" + " ".join(f"{k}{row.coords[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if k in row.coords) + ")"
    if host:
        label += f" @{row.host}"
    parts = [label + (" WORST" if row.worst else ""), str(row.status), *_numbers(row)]
    pipe = row.pipeline
    if pipe.get("in_flight_forwards", 1) > 1:  # the schedule holds several forwards' activations
        held = (f"{pipe['in_flight_forwards']} forwards of {pipe['num_model_chunks']} chunks"
                if pipe.get("num_model_chunks", 1) > 1 else f"{pipe['in_flight_forwards']} micro-batches")
        parts.append(f"in flight {pipe['in_flight_ledger_bytes'] / 2**20:.2f} MiB ({held} of "
                     f"{pipe['num_microbatches']})")
    if row.step_ms is not None:
        parts.append(f"step {row.step_ms:.1f} ms")
    if row.last_loss is not None:
        parts.append(f"loss {row.last_loss:.3f}")
    return " | ".join(parts)
