"""A run's measurement beside the prediction for its config, rank by rank (``python -m recipes estimate --compare``)."""

from __future__ import annotations

from fractions import Fraction

from recipes.config import typed, upgrade
from recipes.files import GIB
from recipes.predict.activations import balanced_rows
from recipes.predict.dims import dims
from recipes.predict.estimate import predict
from recipes.recompute import MLP_KIND
from recipes.results import result_rows


def recorded_shares(cfg: dict, device: str, rank: dict) -> tuple[list | None, Fraction | None]:
    """The routed shares a run recorded on one rank (``rank["moe_routing"]``, written by the worker):
    (one per layer of the ledger's micro-batch, the timed steps' worst micro-batch over all layers),
    exact fractions of ``balanced_rows``; (None, None) without expert parallel or a record."""
    cfg = typed(cfg)
    routing = rank.get("moe_routing") or {}
    if MLP_KIND.get(cfg.model.family) != "moe" or cfg.parallel.expert_model_parallel_size == 1 or not routing:
        return None, None
    balanced = balanced_rows(dims(cfg, device))
    ledger = [Fraction(rows, balanced) for rows in routing.get("ledger_rows") or []] or None
    steps, layers = routing.get("max_rows_per_step") or [], routing.get("layers")
    peak = Fraction(max(steps), balanced * layers) if steps and layers else None
    return ledger, peak


def compare_result(result: dict, name: str | None = None) -> list[dict]:
    """Predicted next to measured for every rank of one run (its merged ``result.json``).

    Under expert parallel each rank is priced at the routing it recorded (``recorded_shares``): its
    ledger at the ledger micro-batch's rows per layer (then exact), its peak at the timed steps'
    worst micro-batch; a rank without a record (results before the worker kept one) at balanced
    routing (share 1), never at the before-a-run bound."""
    result = {**result, "config": upgrade(result["config"])}
    rows = []
    ranks = {r.get("rank", i): r for i, r in enumerate(result.get("ranks") or [])}
    for r in result_rows(result):
        if r.status != "ok" or r.ledger_bytes is None:
            continue
        device = "cpu" if (r.device or "cpu") == "cpu" else "cuda"
        cfg, stage = result["config"], r.coords["pp"]
        ledger_share, peak_share = recorded_shares(cfg, device, ranks.get(r.rank) or {})
        p = predict(cfg, device, stage=stage, routed_share=ledger_share or 1)
        peak = p if peak_share is None else predict(cfg, device, stage=stage, routed_share=peak_share)
        ep = p["routed_share"] is not None
        measured_host = ((ranks.get(r.rank) or {}).get("ledger") or {}).get("host_total_bytes")
        rows.append({"name": name or result.get("name"), "recompute": r.recompute, "rank": r.rank, "device": device,
                     "predicted_host_bytes": p["host_bytes"] if measured_host is not None else None,
                     "measured_host_bytes": measured_host,
                     "predicted_ledger_bytes": p["activation_bytes"], "measured_ledger_bytes": r.ledger_bytes,
                     "predicted_peak_gib": peak["peak_bytes"] / GIB, "measured_peak_gib": r.peak_allocated_gib,
                     "routing": None if not ep else "recorded" if ledger_share else "balanced",
                     "ledger_share": mean_share(p["routed_share"]) if ep else None,
                     "peak_share": mean_share(peak["routed_share"]) if ep else None})
    return rows


def mean_share(share: float | list) -> float:
    """The routed share a prediction used, averaged over the layers where it is one a layer."""
    return sum(share) / len(share) if isinstance(share, list) else share


def format_comparison(rows: list[dict]) -> str:
    """One line per rank: run names whole and the recompute option of each (a short point directory
    may not hold it). Under expert parallel the last column is the routed share each prediction
    used (ledger / peak)."""
    width = max([len(str(r["name"])) for r in rows] + [3]) + 1
    rc = max([len(str(r.get("recompute"))) for r in rows] + [9]) + 1
    ep = any(r.get("routing") for r in rows)
    lines = [f"{'run':{width}s}{'recompute':{rc}s}{'rank':>5s}{'ledger MiB pred':>16s}{'meas':>10s}{'err':>8s}"
             f"{'peak GiB pred':>15s}{'meas':>8s}{'err':>8s}" + ("  routed share (ledger/peak)" if ep else "")]
    for r in rows:
        pl, ml, pk, mk = (r["predicted_ledger_bytes"], r["measured_ledger_bytes"],
                          r["predicted_peak_gib"], r["measured_peak_gib"])
        peak = f"{pk:15.2f}{mk:8.2f}{(pk - mk) / mk:+8.1%}" if mk else f"{pk:15.2f}{'-':>8s}{'-':>8s}"
        share = ""
        if r.get("routing") == "recorded":
            share = f"  {r['ledger_share']:.3f}x / {r['peak_share']:.3f}x (recorded)"
        elif r.get("routing"):
            share = "  1x (balanced: no routing recorded)"
        host = ""
        if r.get("measured_host_bytes") is not None:
            host = (f"  host MiB {r['predicted_host_bytes'] / 2**20:.1f} predicted / "
                    f"{r['measured_host_bytes'] / 2**20:.1f} measured")
        lines.append(f"{str(r['name']):{width}s}{str(r.get('recompute')):{rc}s}{r['rank']:5d}{pl / 2**20:16.1f}{ml / 2**20:10.1f}"
                     f"{(pl - ml) / ml:+8.1%}" + peak + share + host)
    return "\n".join(lines)
