"""Experiment logging: W&B (offline by default) or nothing.

The W&B run gets the resolved config plus the Hydra choices, the loss curve, and the summary with
``/`` keys (``mem/peak_allocated_gib``, ``perf/tokens_per_s``, ``ledger/core_attn_bytes``...). The run
always finishes, even when logging fails, so one bad point does not break the next.

Logging never costs a result or a report: with ``logger.mode=online`` the credentials and the server are
checked once per process in bounded time (``usable_logger``), falling back to offline with one warning
line (W&B online without a network otherwise hangs about 95 s per point, then raises); and any error
while logging is a warning (``log_run``), never an exception.
"""

from __future__ import annotations

import base64
import netrc
import os
import sys
import threading
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlparse

from recipes.results import result_rows, worst_row


def run_metrics(result: dict) -> dict[str, Any]:
    """The flat ``/``-keyed summary of a run (worst rank) for W&B."""
    row = worst_row(result)
    metrics = {
        "status": row.point_status,
        "mem/peak_allocated_gib": row.peak_allocated_gib,
        "mem/peak_reserved_gib": row.peak_reserved_gib,
        "mem/fragmentation_gib": row.fragmentation_gib,
        "mem/activation_gib": row.activation_gib,
        "perf/step_time_s": row.step_time_s,
        "perf/tokens_per_s": row.tokens_per_s,
        "perf/mfu": row.mfu,
        "ledger/total_bytes": row.ledger_bytes,
    }
    ranks = result.get("ranks") or []
    worst = next((r for r in ranks if r.get("rank") == result.get("worst_rank")), None)
    if worst:
        for kind, b in ((worst.get("ledger") or {}).get("bytes_by_kind") or {}).items():
            metrics[f"ledger/{kind}_bytes"] = b
        for label, counts in (worst.get("checkpoints") or {}).items():
            metrics[f"ckpt/{label}_forward"] = counts["forward"]
            metrics[f"ckpt/{label}_recompute"] = counts["recompute"]
    if len(ranks) > 1:
        metrics["worst_rank"] = result.get("worst_rank")
    for r in result_rows(result) if ranks else []:  # every rank: rank<N>/... (coordinates under rank<N>/coords/)
        metrics[f"rank{r.rank}/mem/peak_allocated_gib"] = r.peak_allocated_gib
        metrics[f"rank{r.rank}/mem/peak_reserved_gib"] = r.peak_reserved_gib
        if len(ranks) > 1:
            metrics[f"rank{r.rank}/ledger/total_bytes"] = r.ledger_bytes
            metrics[f"rank{r.rank}/ledger/in_flight_bytes"] = r.pipeline.get("in_flight_ledger_bytes")
            metrics[f"rank{r.rank}/perf/step_time_s"] = r.step_time_s
            for axis, index in r.coords.items():
                if axis != "rank":
                    metrics[f"rank{r.rank}/coords/{axis}"] = index
    return {k: v for k, v in metrics.items() if v is not None}


def sweep_group(sweep_dir: str) -> str:
    """The default W&B group of a sweep's points and report: its path below ``multirun/``
    (``moe/size=h200``), else the directory's name."""
    parts = os.path.normpath(os.path.abspath(sweep_dir)).split(os.sep)
    if "multirun" in parts[:-1]:
        return "/".join(parts[len(parts) - parts[::-1].index("multirun"):])
    return parts[-1]


#: Seconds the online check may take (the server's name lookup and a TCP connect).
ONLINE_CHECK_S = 5.0
_checked: dict[str, str | None] = {}  # server -> why it cannot be used (None: usable), once per process


def online_problem(timeout_s: float = ONLINE_CHECK_S) -> str | None:
    """Why W&B online cannot work from here (no API key, server unreachable), or None. Bounded in time:
    the name lookup runs in a thread that is abandoned after ``timeout_s``."""
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host, port = url.hostname or "api.wandb.ai", url.port or (443 if url.scheme != "http" else 80)
    if host in _checked:
        return _checked[host]
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        try:
            key = (netrc.netrc().authenticators(host) or (None, None, None))[2]
        except (OSError, netrc.NetrcParseError):
            key = None
    problem = None if key else f"no W&B API key for {host} (set WANDB_API_KEY or run `wandb login`)"
    if problem is None:
        outcome: list[str | None] = []

        def connect() -> None:  # W&B's own API with the key: a TCP connect alone may reach a proxy
            request = urllib.request.Request(
                f"{url.scheme or 'https'}://{host}:{port}/graphql", data=b'{"query": "{ viewer { id } }"}',
                headers={"Content-Type": "application/json",
                         "Authorization": "Basic " + base64.b64encode(f"api:{key}".encode()).decode()})
            try:
                urllib.request.urlopen(request, timeout=timeout_s).close()
                outcome.append(None)
            except urllib.error.HTTPError as err:
                refused = err.code in (401, 403)
                outcome.append(f"{host} refused the API key (HTTP {err.code})" if refused
                               else f"{host}:{port} answered HTTP {err.code}, not W&B's API")
            except (OSError, ValueError) as err:
                outcome.append(f"{host}:{port} is unreachable ({getattr(err, 'reason', err)})")

        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        thread.join(timeout_s)
        problem = outcome[0] if outcome else f"{host}:{port} did not answer within {timeout_s:.0f} s"
    _checked[host] = problem
    return problem


def usable_logger(log: dict) -> dict:
    """``log`` (a ``logger`` config section), with ``mode=offline`` when online cannot work from here;
    says so once per process (a sweep's points share the answer)."""
    if log.get("name") != "wandb" or log.get("mode") != "online":
        return log
    fresh = not _checked
    problem = online_problem()
    if problem is None:
        return log
    if fresh:
        print(f"warning: W&B online: {problem}; logging offline instead (wandb sync later)", file=sys.stderr,
              flush=True)
    return {**log, "mode": "offline"}


def log_run(cfg: dict, result: dict) -> bool:
    """Log one finished run to the configured logger (no-op for logger=none). A logging failure is one
    warning line: the result is already on disk. Returns whether it was logged."""
    if cfg["logger"]["name"] != "wandb":
        return False
    try:
        _log_run(cfg, result)
        return True
    except Exception as err:
        print(f"warning: W&B logging failed for {result.get('name')} ({type(err).__name__}: "
              f"{str(err).splitlines()[0] if str(err) else ''}); the result is in {result.get('run_dir')}",
              file=sys.stderr, flush=True)
        return False


def _log_run(cfg: dict, result: dict) -> None:
    log = usable_logger(cfg["logger"])
    os.environ.setdefault("WANDB_SILENT", "true")
    # lazy: only with logger=wandb
    import wandb

    run = wandb.init(
        project=log["project"],
        entity=log["entity"],
        mode=log["mode"],
        group=log["group"] or sweep_group(os.path.dirname(result["run_dir"])),
        name=result["name"],
        tags=list(log["tags"]),
        dir=result["run_dir"],
        config={**cfg, "choices": result.get("choices", {})},
        reinit="finish_previous",
    )
    try:
        worst = next((r for r in result.get("ranks", []) if r.get("rank") == result.get("worst_rank")), {})
        rows: dict[int, dict] = {}  # one log call per step: W&B drops steps that go backwards
        for step, loss in enumerate(worst.get("loss") or []):
            if loss is not None:
                rows.setdefault(step, {})["train/loss"] = loss
        for ev in worst.get("eval_loss") or []:  # after ev["step"] steps = the step logged at step-1
            if ev.get("loss") is not None:
                rows.setdefault(ev["step"] - 1, {})["val/loss"] = ev["loss"]
        for step in sorted(rows):
            run.log(rows[step], step=step)
        for key, value in run_metrics(result).items():
            run.summary[key] = value
    finally:
        run.finish()
