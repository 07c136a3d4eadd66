"""A refusal answers before torch, megatron-core or the model code loads, exits 2, and names the option
and the fix; ``--help`` lists the groups and options a user picks. ``benchmarks/bench_refusal.py``
prints how long a refusal takes (no timed test here: these assert what was imported and printed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

#: Runs train.py as ``python train.py ARGS`` would, as on a machine without a GPU driver (whatever this one
#: has: a GPU machine imports torch to count its GPUs), and prints the heavy modules loaded by the end.
PROBE = """
import atexit, json, runpy, sys
import recipes.validate
recipes.validate.GPU_DRIVER_FILES = ()
heavy = ("torch", "megatron", "transformer_engine", "numpy", "recipes.build.model", "recipes.run.worker")
atexit.register(lambda: print("LOADED " + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy
                                                             or m in heavy))))
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def probe(*args: str, cwd=None) -> tuple[subprocess.CompletedProcess, list[str]]:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd or REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("LOADED ")), "LOADED null")
    return done, json.loads(line.removeprefix("LOADED "))


def test_the_validate_path_imports_no_torch_or_megatron():
    """What train.py and the controller import before a point is checked: none of torch, megatron, numpy."""
    code = ("import sys; import train; import recipes.run.controller, recipes.run.submission, "
            "recipes.predict.estimate, recipes.analyze.report; "
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy')])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("args, option", [
    (["recompute=selective/moe_act"], "recompute=selective/moe_act"),  # a rule
    (["checkpoint.interval=-1"], "checkpoint.interval"),  # a domain
    (["train.seq_length=10000000"], "allow_over_memory"),  # the estimator's peak above this machine
    # past the share_storage check (a CPU run: torch's version says whether it can share in Python) and
    # the host-copy check (no GPU driver: the estimator's device is the CPU)
    (["recompute=selective/mlp", "offload=attn_norm", "offload.emulate_on_cpu=true", "train.seq_length=10000000"],
     "allow_over_memory"),
    (["model.hiden_size=3"], "model.hiden_size"),  # Hydra: a typo'd key
    (["model=mooe"], "model=mooe"),  # Hydra: an unknown option
    (["train.lr=x"], "train.lr"),  # Hydra: not a number
    (["train.fused_adam=2"], "train.fused_adam"),  # a switch OmegaConf would read as true
    (["~model"], "model.family"),  # a deleted group: its values unset
    (["model=[a"], "overrides"),  # Hydra cannot parse it: the message quotes it
    (["cluster.gpu=nosuch"], "cluster.gpu"),  # a typo'd profile, refused by train.py too
])
def test_a_refusal_exits_2_naming_the_option_and_the_fix_before_torch_loads(args, option, tmp_path):
    done, loaded = probe(*args, f"output_dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: {option}:") and "\n  fix: " in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    assert loaded == [], loaded
    assert not (tmp_path / "run").exists()
    if option == "overrides":
        assert "'model=[a'" in done.stderr


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    done, _ = probe(f"output_dir={blocker / 'run'}")
    assert done.returncode == 2 and "error: output_dir:" in done.stderr and "is a file" in done.stderr
    assert "fix:" in done.stderr


@pytest.mark.parametrize("args, option", [
    (["checkpoint=default", "checkpoint.dir=FILE/c"], "checkpoint.dir"),  # the first save would stop the run
    (["data=indexed", "data.paths=[DATA]", "data.split='100,0,0'", "data.cache_dir=FILE"], "data.cache_dir"),
])
def test_a_checkpoint_or_cache_dir_that_cannot_be_written_is_refused_before_launch(args, option, tmp_path):
    from recipes.data.preprocess import preprocess

    (tmp_path / "FILE").write_text("")
    (tmp_path / "t.txt").write_text("a little text for a dataset.\n" * 50)
    preprocess([str(tmp_path / "t.txt")], str(tmp_path / "d"), "byte", True)
    paths = {"FILE": str(tmp_path / "FILE"), "DATA": str(tmp_path / "d_text_document")}
    done, _ = probe(*[a.replace("FILE", paths["FILE"]).replace("DATA", paths["DATA"]) for a in args], "size=tiny",
                    f"output_dir={tmp_path / 'run'}")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {option}:") and "is a file" in done.stderr, done.stderr
    assert "fix:" in done.stderr and "Traceback" not in done.stderr


def test_a_local_sweep_refuses_its_invalid_point_before_any_runs(tmp_path):
    sweep = tmp_path / "sweep"
    done, _ = probe("-m", "recompute=none,selective/moe_act", f"hydra.sweep.dir={sweep}", "dry_run=true")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: recompute=selective/moe_act:" in done.stderr and "no point was run" in done.stderr
    assert "fix:" in done.stderr and not list(sweep.rglob("config.yaml"))


def test_help_lists_the_options_a_user_picks_not_the_schema():
    done = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "_schema" not in done.stdout
    assert "model: gdn, gdn_moe, mla, mla_moe, moe, standard_attn" in done.stdout
    assert "recompute/selective: core_attn" in done.stdout
