"""Every file a tool reads may be wrong: a sweep holding a result.json that is not a run's result.

``python -m recipes report|advise|estimate --compare`` name each bad file and skip it (a ``warning:``
line with the fix), and exit 2 when nothing readable is left (docs/outputs.md's exit codes); a
sweep's controller treats such a file as an incomplete point and runs it again. Never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_advise import rank_result, write_point

from recipes.analyze import advise, report
from recipes.predict import estimate_command
from recipes.results import BadResult, load_result

#: name -> what is written as the point's result.json (a str: the file's text; None: a directory)
BAD = {
    "list": "[1, 2]",
    "truncated": '{"status": "ok", "ran',
    "empty": "",
    "status_number": json.dumps({"status": 3, "ranks": []}),
    "ranks_string": json.dumps({"status": "ok", "ranks": "x"}),
    "rank_field": json.dumps({"status": "ok", "ranks": [{"rank": 0, "memory": [1]}]}),
    "rank_number": json.dumps({"status": "ok", "ranks": [{"rank": 0, "timing": {"step_time_s": "fast"}}]}),
    "config_section": json.dumps({"status": "ok", "config": {"model": 3}, "ranks": []}),
    "config_leaf": json.dumps({"status": "ok", "config": {"train": {"micro_batch_size": "two"}}, "ranks": []}),
    "unknown_status": json.dumps({"status": "done", "ranks": []}),
    "directory": None,
}
#: what each message names as wrong
WHY = {"list": "a JSON list, not an object", "truncated": "not JSON", "empty": "not JSON",
       "status_number": "status is a number, not a string", "ranks_string": "ranks is a string, not a list",
       "rank_field": "ranks[0].memory is a list, not an object",
       "rank_number": "ranks[0].timing.step_time_s is a string, not a number",
       "config_section": "config.model is a number, not an object",
       "config_leaf": "config.train.micro_batch_size is a string, not a number",
       "unknown_status": "status 'done' is none of", "directory": "a directory"}
FIX = "move it away or delete it (re-running the sweep's command measures that point again)"


def write_bad(sweep: Path, name: str) -> Path:
    path = sweep / f"bad_{name}" / "result.json"
    if BAD[name] is None:
        path.mkdir(parents=True)
    else:
        path.parent.mkdir(parents=True)
        path.write_text(BAD[name])
    return path


@pytest.fixture(scope="module")
def good_sweep(tmp_path_factory) -> Path:
    """Two measured points (GPU numbers, with a ledger so that --compare prices them)."""
    root = tmp_path_factory.mktemp("good")
    for recompute, measured in (("none", (38.9, 39.7, 0.196)), ("full", (13.3, 17.4, 0.266))):
        rank = rank_result(0, measured, ledger_bytes=2**30)
        rank["coords"] = {"pp": 0, "tp": 0, "dp": 0, "ep": 0, "cp": 0, "rank": 0}
        write_point(root, "unfused", recompute, [rank])
    return root


@pytest.mark.parametrize("name", BAD)
def test_load_result_names_the_file_what_is_wrong_and_the_fix(tmp_path, name):
    path = write_bad(tmp_path, name)
    with pytest.raises(BadResult) as err:
        load_result(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and WHY[name] in message and FIX in message


def test_every_stored_result_of_this_repository_still_loads(tmp_path):
    """The check refuses only what is wrong: each result kept in docs/evidence/ loads."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import evidence

    results = [r for name in ("h200", "h200x2", "offload-h200", "speed-h200") for r in evidence.load(name).results()]
    assert len(results) > 300
    for i, result in enumerate(results):
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(result))
        load_result(path)


@pytest.mark.parametrize("tool", ["report", "advise", "compare"])
def test_tools_skip_each_bad_result_by_name_and_use_the_rest(good_sweep, tmp_path, tool, capsys):
    import shutil

    sweep = tmp_path / "sweep"
    shutil.copytree(good_sweep, sweep)
    bad = [write_bad(sweep, name) for name in BAD]
    code = {"report": lambda: report.main([str(sweep), "--no-wandb"]),
            "advise": lambda: advise.main([str(sweep), "--budget-gib", "20"]),
            "compare": lambda: estimate_command.main(["--compare", str(sweep)])}[tool]()
    out, err = capsys.readouterr()
    assert code == 0, err
    for path in bad:
        assert f"warning: skipped {path}: " in err
    assert err.count(FIX) == len(bad)
    assert "Traceback" not in err
    assert "unfused" in out  # the good points are still reported


@pytest.mark.parametrize("tool", ["report", "advise", "compare"])
def test_a_sweep_of_only_bad_results_is_refused_with_exit_2(tmp_path, tool, capsys):
    for name in ("list", "directory"):
        write_bad(tmp_path, name)
    code = {"report": lambda: report.main([str(tmp_path), "--no-wandb"]),
            "advise": lambda: advise.main([str(tmp_path), "--budget-gib", "20"]),
            "compare": lambda: estimate_command.main(["--compare", str(tmp_path)])}[tool]()
    err = capsys.readouterr().err
    assert code == 2
    assert f"warning: skipped {tmp_path / 'bad_list' / 'result.json'}" in err
    assert f"no result.json under {tmp_path}" in err or f"no completed result.json under {tmp_path}" in err


@pytest.mark.parametrize("tool", ["report", "advise", "compare"])
def test_a_result_json_that_is_a_device_is_skipped_not_read_forever(tmp_path, tool, capsys):
    path = tmp_path / "point" / "result.json"
    path.parent.mkdir()
    path.symlink_to("/dev/zero")  # reading it never ends
    code = {"report": lambda: report.main([str(tmp_path), "--no-wandb"]),
            "advise": lambda: advise.main([str(tmp_path), "--budget-gib", "20"]),
            "compare": lambda: estimate_command.main(["--compare", str(tmp_path)])}[tool]()
    err = capsys.readouterr().err
    assert code == 2 and f"warning: skipped {path}: not a regular file" in err, err


def test_compare_of_a_missing_directory_is_refused_with_exit_2(tmp_path, capsys):
    assert estimate_command.main(["--compare", str(tmp_path / "nowhere")]) == 2
    assert f"--compare {tmp_path / 'nowhere'}: not a directory" in capsys.readouterr().err


def test_a_sweep_reruns_a_point_whose_result_is_not_a_result(tmp_path, capsys):
    """The controller reads a point's stored result through the same check: a bad one is named and
    the point runs again instead of the sweep stopping on a traceback."""
    from recipes.run.controller import stored

    write_bad(tmp_path, "list")
    assert stored(tmp_path / "bad_list") is None
    err = capsys.readouterr().err
    assert "bad_list/result.json: not a run's result" in err and "this point runs again" in err
