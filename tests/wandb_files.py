"""Read W&B's offline run files back, without a network and without W&B's server API.

wandb 0.31 has no Python reader of its transaction log (the ``datastore`` module went with the Go core),
so this is one: ``RUN_DIR/wandb/offline-run-*/run-<id>.wandb`` is a LevelDB log (32 KiB blocks of
records, each ``crc32 (uint32) | length (uint16) | type (uint8) | data``; FULL=1, FIRST=2, MIDDLE=3, LAST=4)
after a 7-byte header (``:W&B``, magic 0xBEE1, version 0), and each record's data is one
``wandb.proto.wandb_internal_pb2.Record``. Checksums are verified, so a reader that drifted from the
format fails loudly instead of returning nothing.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: Path) -> list:
    """Every protobuf ``Record`` in one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B transaction log"
    out, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's trailer: zero padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zeros to the end of the block
            pos += room
            continue
        payload = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at byte {pos}"
        pos += HEADER + length
        pending += payload
        if kind in (1, 4):  # FULL, LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    """What one offline run file holds."""

    path: Path
    id: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    config: dict = field(default_factory=dict)
    history: dict[int, dict] = field(default_factory=dict)  # step -> {key: value} (W&B's own keys dropped)
    summary: dict = field(default_factory=dict)  # as last updated (history values, then the run's own)
    exit_code: int | None = None


def read_run(path: Path) -> OfflineRun:
    run = OfflineRun(Path(path))
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.id, run.name = record.run.run_id, record.run.display_name
            run.group, run.job_type = record.run.run_group, record.run.job_type
            run.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            run.history.setdefault(record.history.step.num, {}).update(
                {k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "summary":
            run.summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update
                                if _key(i) and not _key(i).startswith("_")})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    """Every offline run under ``RUN_DIR/wandb/``, oldest first."""
    return [read_run(p) for p in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))]
