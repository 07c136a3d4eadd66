"""result.json and the other JSON files: written atomically with a plain open's permissions and no
process-wide umask change; a full disk or an unwritable directory ends the run with a record."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from recipes.files import write_json_atomic, write_json_or_fallback


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_with_a_plain_opens_permissions_without_touching_the_umask(tmp_path, monkeypatch, mask, mode):
    old = os.umask(mask)
    try:
        def no_umask(_):  # another thread would see a changed umask for that moment
            raise AssertionError("write_json_atomic changed the process's umask")

        monkeypatch.setattr(os, "umask", no_umask)
        threads = [threading.Thread(target=write_json_atomic, args=(tmp_path / f"r{i}.json", {"i": i})) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        monkeypatch.undo()
    finally:
        os.umask(old)
    for i in range(4):
        path = tmp_path / f"r{i}.json"
        assert json.loads(path.read_text()) == {"i": i}
        assert path.stat().st_mode & 0o777 == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"r{i}.json" for i in range(4)]  # no temp left


def test_a_full_disk_keeps_the_small_record_and_returns_the_error(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    calls = {"n": 0}
    real = os.fsync

    def fsync(fd):  # the big write fails, the small one fits
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    err = write_json_or_fallback(path, {"big": list(range(1000))}, {"status": "failed"})
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert json.loads(path.read_text()) == {"status": "failed"}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


@pytest.mark.parametrize("room", [1, 0], ids=["small-record-fits", "nothing-fits"])
def test_the_controller_ends_a_run_on_a_full_disk_naming_the_path_and_what_was_kept(tmp_path, monkeypatch, capsys, room):
    from recipes.run.controller import record

    result = {"schema_version": 1, "name": "x", "status": "ok", "config": {"train": {"train_iters": 4}},
              "ranks": [{"rank": 0, "status": "ok", "loss": [1.0] * 100,
                         "checkpoint": {"path": str(tmp_path / "checkpoints" / "step_00000004"), "step": 4}}]}
    calls = {"n": 0}
    real = os.fsync

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] == 1 or not room:  # the whole result never fits; the small record when there is room
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    got = record(tmp_path, result)
    err = capsys.readouterr().err
    path = tmp_path / "result.json"
    assert got["status"] == "failed" and str(path) in got["error"] and "No space left" in got["error"]
    assert str(path) in err and "kept: checkpoint of step 4 at" in err and "worker.log" in err
    if room:
        small = json.loads(path.read_text())
        assert small["status"] == "failed" and small["checkpoint"]["step"] == 4 and small["config"] == result["config"]
        assert "loss" not in small["ranks"][0]
    else:
        assert not path.exists()
