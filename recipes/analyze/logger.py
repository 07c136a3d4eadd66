"""Experiment logging: W&B (offline by default) or nothing, streamed live from the worker.

Who logs what (one home each):

- The controller, once per sweep, before any worker: ``usable_logger`` (with ``logger.mode=online`` the
  credentials and the server are checked in bounded time, falling back to offline with one warning line;
  W&B online without a network otherwise hangs about 95 s per point, then raises), then ``write_identity``:
  the run's W&B name, group and job type, and the Hydra choices, in ``RUN_DIR/wandb.json``.
- The worker's rank 0: ``open_run`` at its start (config = the resolved config + the Hydra choices), one
  ``log`` per ``train.log_interval`` (``train/loss``, ``train/lr``, ``train/grad_norm``, ``perf/*``,
  ``mem/peak_allocated_gib``) and per validation (``val/loss``), at the training step; at its end
  ``finish`` with the summary (``run_metrics``: every rank's memory under ``rank<N>/``) and its status.
- The controller again only when the worker could not finish its run (killed, as by the kernel's OOM
  killer): ``close_unfinished`` records the merged result's summary and status in the same W&B run, after
  re-logging the worker's progress rows from ``RUN_DIR/progress.jsonl`` (a killed process loses what W&B
  still buffered; the rows W&B already has are left out when it knows the run's last step).

Logging never costs a result: every W&B error is one warning line, never an exception. The other ranks
get ``NullRun``, the do-nothing twin, as does ``logger=none``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import netrc
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from recipes.config import as_dict
from recipes.files import GIB, PROGRESS_FILE, read_json, write_json_atomic
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
        # what is alive at the profiled step's peak (profile=peak): a CPU run's only memory figure
        "mem/profiled_peak_gib": row.profile_peak_bytes / GIB if row.profile_peak_bytes is not None else None,
        "perf/step_time_s": row.step_time_s,
        "perf/tokens_per_s": row.tokens_per_s,
        "perf/mfu": row.mfu,
        "perf/host_wait_s": row.host_wait_s,
        "ledger/total_bytes": row.ledger_bytes,
        "offload/host_bytes": row.host_bytes,
        "offload/moved_bytes_per_step": row.moved_bytes_per_step,
        "offload/reload_wait_s": row.reload_wait_s,
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
        if r.profile_peak_bytes is not None:
            metrics[f"rank{r.rank}/mem/profiled_peak_gib"] = r.profile_peak_bytes / GIB
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


# --- the live W&B run -------------------------------------------------------------------------------

#: ``RUN_DIR/wandb.json``: the W&B run of this directory (name, group, job type, the Hydra choices), written
#: by the controller; the worker adds the run's id (kept across resumes) and whether it finished it.
IDENTITY = "wandb.json"
#: progress.jsonl's keys (``recipes.run.progress.Progress``) and the W&B keys they are logged under.
LIVE_KEYS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
             "step_time_s": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
             "peak_allocated_gib": "mem/peak_allocated_gib"}


def run_identity(log: dict, name: str, run_dir: str | Path, multirun: bool) -> dict:
    """The W&B name, group and job type of the run in ``run_dir``: the point's name and 6 hex digits of its
    directory's path (two points, or the same point in two sweeps, never share a name; a re-run keeps it),
    ``logger.group`` else the sweep (``sweep_group``), ``logger.job_type`` else ``point`` in a sweep and
    ``train`` for a single run."""
    path = Path(run_dir).resolve()
    return {"name": f"{name} {hashlib.sha1(str(path).encode()).hexdigest()[:6]}",
            "group": log.get("group") or sweep_group(str(path.parent)),
            "job_type": log.get("job_type") or ("point" if multirun else "train")}


def read_identity(run_dir: str | Path) -> dict:
    try:
        return read_json(Path(run_dir) / IDENTITY)
    except (OSError, ValueError):
        return {}


def _update_identity(run_dir: str | Path, **fields: Any) -> None:
    write_json_atomic(Path(run_dir) / IDENTITY, {**read_identity(run_dir), **fields})


def write_identity(run_dir: str | Path, log: dict, name: str, choices: dict, overrides: list[str],
                   multirun: bool) -> None:
    """Controller, before the workers start (``logger=wandb`` only): ``RUN_DIR/wandb.json``. The id of the
    W&B run an earlier process of this directory opened is kept, for a worker that resumes its checkpoint."""
    if log.get("name") != "wandb":
        return
    previous = read_identity(run_dir)
    _update_identity(run_dir, **run_identity(log, name, run_dir, multirun), choices=choices, overrides=overrides,
                     id=previous.get("id"), opened=False, finished=False)


def interval_metrics(row: dict) -> dict[str, float]:
    """One progress row (``Progress.log``) as the W&B metrics logged live (``LIVE_KEYS``)."""
    return {LIVE_KEYS[k]: v for k, v in row.items() if k in LIVE_KEYS and v is not None}


def _warn(what: str, name: str, run_dir: str | Path, err: Exception) -> None:
    first = str(err).splitlines()[0] if str(err) else ""
    print(f"warning: W&B {what} failed for {name} ({type(err).__name__}: {first}); the result is in {run_dir}",
          file=sys.stderr, flush=True)


#: What an offline run keeps readable beside its transaction log (``run-<id>.wandb``, which only
#: ``wandb sync`` reads; wandb 0.31 writes no config or summary file offline): W&B's own file names, in
#: the run's ``files/`` directory, where an online run has them.
OFFLINE_CONFIG, OFFLINE_SUMMARY = "config.yaml", "wandb-summary.json"


def write_offline_files(run, config: dict | None = None, summary: dict | None = None) -> None:
    """An offline run's config (at its start) and summary (at its end) as plain files in ``run.dir``."""
    if not getattr(run, "offline", False):
        return
    import yaml  # PyYAML, OmegaConf's own dependency

    files = Path(run.dir)
    if config is not None:
        (files / OFFLINE_CONFIG).write_text(yaml.safe_dump(json.loads(json.dumps(config, default=str)),
                                                           sort_keys=False))
    if summary is not None:
        write_json_atomic(files / OFFLINE_SUMMARY, summary)


class NullRun:
    """The do-nothing twin of ``WandbRun``: ``logger=none``, every rank but 0, a W&B run that did not open."""

    def __bool__(self) -> bool:
        return False

    def log(self, metrics: dict, step: int, commit: bool | None = None) -> None:
        pass

    def finish(self, result: dict, exit_code: int = 0) -> None:
        pass


class WandbRun:
    """An open W&B run. ``log`` and ``finish`` never raise: a failure is one warning line (the first
    logging failure stops the live logging; the summary is still tried at the end)."""

    def __init__(self, run, run_dir: str | Path, name: str):
        self.run, self.run_dir, self.name = run, Path(run_dir), name
        self.logging = True

    def log(self, metrics: dict, step: int, commit: bool | None = None) -> None:
        """``metrics`` (None values dropped) at training step ``step``. Calls at one step make one row,
        written when a later step is logged or ``commit`` (the step's last call: then ``finish``'s summary
        comes after it, and the summary's window numbers are not overwritten by the last row's)."""
        metrics = {k: v for k, v in metrics.items() if v is not None}
        if not metrics or not self.logging:
            return
        try:
            self.run.log(metrics, step=step, commit=commit)
        except Exception as err:
            self.logging = False
            _warn("logging", self.name, self.run_dir, err)

    def finish(self, result: dict, exit_code: int = 0) -> None:
        """The run's summary (``run_metrics``: the worst rank, and every rank under ``rank<N>/``), its
        error when it failed, then finish with ``exit_code`` (W&B shows a non-zero one as failed; a
        preempted run is marked preempting)."""
        if self.run is None:
            return
        try:
            for key, value in run_metrics(result).items():
                self.run.summary[key] = value
            if result.get("status") not in ("ok", None) and result.get("error"):
                self.run.summary["error"] = str(result["error"]).splitlines()[0]
            if result.get("status") == "preempted":
                self.run.mark_preempting()
            write_offline_files(self.run, summary={k: v for k, v in dict(self.run.summary).items()
                                                   if not k.startswith("_")})
            self.run.finish(exit_code=exit_code)
            _update_identity(self.run_dir, finished=True)
        except Exception as err:
            _warn("finishing the run", self.name, self.run_dir, err)
        finally:
            self.run = None


def _init(log: dict, identity: dict, run_dir: Path, run_id: str | None, config: dict | None):
    os.environ.setdefault("WANDB_SILENT", "true")
    # lazy: only with logger=wandb
    import wandb

    return wandb.init(project=log["project"], entity=log["entity"], mode=log["mode"], group=identity["group"],
                      name=identity["name"], job_type=identity["job_type"], tags=list(log.get("tags") or []),
                      dir=str(run_dir), id=run_id, resume="allow" if run_id else None,
                      config=config, reinit="finish_previous")


def open_run(cfg: dict, run_dir: str | Path, rank: int, resuming: bool = False) -> WandbRun | NullRun:
    """The worker's W&B run: opened on rank 0 with ``logger=wandb`` (else ``NullRun``), under the identity
    the controller wrote (``RUN_DIR/wandb.json``; without one, the directory's name). ``resuming`` (this
    process continues a checkpoint) continues the W&B run the earlier process opened. Never raises."""
    plain = as_dict(cfg)  # W&B's config: plain data
    log = plain["logger"]
    if log["name"] != "wandb" or rank != 0:
        return NullRun()
    run_dir = Path(run_dir)
    identity = read_identity(run_dir) or run_identity(log, run_dir.name, run_dir, False)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        config = {**plain, "choices": identity.get("choices") or {}, "overrides": identity.get("overrides") or [],
                  "run_dir": str(run_dir)}
        run = _init(log, identity, run_dir, identity.get("id") if resuming else None, config)
        write_offline_files(run, config=config)
        _update_identity(run_dir, **{k: identity[k] for k in ("name", "group", "job_type")}, id=run.id,
                         opened=True, opened_at=time.time(), finished=False)
        return WandbRun(run, run_dir, identity["name"])
    except Exception as err:
        _warn("opening the run", identity["name"], run_dir, err)
        return NullRun()


#: A run's exit code for W&B, by status, when the controller closes a run its worker could not.
_EXIT = {"ok": 0, "stopped": 0, "preempted": 0, "failed": 1, "refused": 2, "oom": 3}


def close_unfinished(log: dict, result: dict) -> bool:
    """Controller, after the result is merged: a W&B run the worker opened but never finished (the worker
    was killed) gets the result's summary and status now, in the same run. Returns whether it did."""
    run_dir = result.get("run_dir")
    identity = read_identity(run_dir) if run_dir else {}
    if log.get("name") != "wandb" or not identity.get("opened") or identity.get("finished") or not identity.get("id"):
        return False
    try:
        run = _init(log, identity, Path(run_dir), identity["id"], None)
    except Exception as err:
        _warn("closing the run", identity.get("name"), run_dir, err)
        return False
    closing = WandbRun(run, run_dir, identity["name"])
    for row in _unfinished_rows(Path(run_dir), identity.get("opened_at", 0.0), run.step):
        closing.log({**interval_metrics(row), "val/loss": row.get("val_loss")}, row["step"], commit=True)
    closing.finish(result, _EXIT.get(result.get("status"), 1))
    return True


def _unfinished_rows(run_dir: Path, opened_at: float, next_step: int) -> list[dict]:
    """The progress rows the killed worker wrote after it opened its W&B run, from ``next_step`` on (the
    step W&B continues at: online, after the rows it already has; offline it knows none, so 0)."""
    path = run_dir / PROGRESS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the last line, cut by the kill
            continue
        if row.get("time", 0.0) >= opened_at and row.get("step", -1) >= next_step:
            rows.append(row)
    return rows
