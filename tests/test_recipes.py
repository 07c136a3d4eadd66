"""Named recipes (conf/recipe/): published shapes and layouts, reduced depth here, refusals before launch."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF, REPO, train_in_process

from recipes.errors import ConfigError
from recipes.predict.estimate import predict
from recipes.recipe import at_full_depth, compose_recipe
from recipes.recompute import layer_kinds

RECIPES = sorted(p.stem for p in (Path(CONF) / "recipe").glob("*.yaml"))


def test_the_issues_recipes_exist():
    assert {"llama3_8b", "llama3_70b", "qwen3_30b_a3b", "moonlight_16b_a3b", "deepseek_v3",
            "qwen3_next_80b_a3b"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_composes_validates_and_predicts_every_rank(name):
    full, notes = compose_recipe(at_full_depth([f"recipe={name}"]))
    assert full["recipe"]["full_depth"] and "full depth" in notes[0] and full["recipe"]["sources"]
    text = (Path(CONF) / "recipe" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_") and "config.json" in text  # cites its numbers
    p = predict(full, device="cuda")
    assert len(p["stages"]) == full["parallel"]["pipeline_model_parallel_size"]
    assert sum(s["num_layers"] for s in p["stages"]) == full["model"]["num_layers"]
    reduced, notes = compose_recipe([f"recipe={name}"], on_gpu=True)
    assert reduced["model"]["num_layers"] < full["model"]["num_layers"] and "reduced depth" in notes[0]
    assert reduced["launcher"]["nproc_per_node"] * reduced["launcher"]["nnodes"] == 1
    assert reduced["model"]["hidden_size"] == full["model"]["hidden_size"]  # the same per-layer shape on a GPU
    assert {k[0] for k in layer_kinds(reduced["model"])} <= {k[0] for k in layer_kinds(full["model"])}


def test_deepseek_v3_structure():
    cfg, _ = compose_recipe(at_full_depth(["recipe=deepseek_v3"]))
    kinds = layer_kinds(cfg["model"])
    assert kinds[:3] == [("mla", "dense")] * 3 and set(kinds[3:]) == {("mla", "moe")} and len(kinds) == 61
    stages = predict(cfg, device="cuda")["stages"]
    assert [s["num_layers"] for s in stages] == [8, 8, 8, 8, 8, 8, 8, 5]  # Bridge's PP-8 layout, MTP omitted
    reduced, _ = compose_recipe(["recipe=deepseek_v3"], on_gpu=True)
    assert layer_kinds(reduced["model"]) == [("mla", "dense")] + [("mla", "moe")] * 3


@pytest.mark.parametrize("name", ["llama3_8b", "deepseek_v3", "qwen3_next_80b_a3b", "moonlight_16b_a3b"])
def test_reduced_recipe_trains_here(megatron_world, name):
    cfg, notes = compose_recipe([f"recipe={name}", "train.train_iters=3", "measure.start_step=2",
                                 "measure.profile=none"], on_gpu=False)
    assert any("widths are shrunk" in n for n in notes)  # said, not silent
    result = train_in_process(cfg)
    assert result["status"] == "ok", result.get("error")
    assert all(math.isfinite(x) for x in result["loss"])


@pytest.mark.parametrize("overrides,option", [
    (["recipe=qwen3_30b_a3b", "launcher.nproc_per_node=6"], "launcher.nproc_per_node"),  # 6 GPUs, TP4 x PP2
    (["recipe=deepseek_v3", "parallel.expert_model_parallel_size=48"], "parallel.expert_model_parallel_size"),
    (["recipe=llama3_8b", "recompute=selective/moe_act"], "recompute=selective/moe_act"),
    (["recipe=qwen3_30b_a3b", "recompute=selective/mla_up_proj"], "recompute=selective/mla_up_proj"),
    (["recipe=llama3_70b", "model.num_layers=78"], "model.num_layers"),  # 78 layers, PP4 x VPP5
    (["recipe=deepseek_v3", "parallel.num_layers_in_last_pipeline_stage=4"], "parallel.num_layers_in_last_pipeline_stage"),
])
def test_bad_recipes_are_refused_with_the_fix(overrides, option):
    for full in (True, False):  # the published layout is checked even when a reduced run is asked for
        with pytest.raises(ConfigError) as info:
            compose_recipe(overrides + [f"recipe.full_depth={str(full).lower()}"], on_gpu=False)
        assert info.value.option == option and info.value.fix


def test_train_py_prints_the_reduced_depth_note(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "recipe=llama3_8b", "dry_run=true",
                           f"output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[recipe] recipe=llama3_8b: Llama-3.1-8B at reduced depth, 4 of 32 layers" in proc.stdout
    assert "context_parallel_size=2" in proc.stdout  # the TE-only feature, by name


def test_estimate_predicts_every_rank_at_the_published_layout_without_its_gpus(capsys):
    """256 processes on 32 nodes, predicted on a machine with none of them: every stage of every option,
    the worst rank named with its reason, judged against the recipe's GPU."""
    from recipes.predict.estimate_command import main

    assert main(["recipe=deepseek_v3", "--all"]) == 0
    out = capsys.readouterr().out
    assert "256 processes" in out and "fits 77?" in out  # the H100 budget, from the recipe
    assert "peak per pipeline stage" in out and "pp7" in out and "worst rank (full): pipeline stage" in out
    assert "routed tokens" in out
    assert main(["recipe=llama3_70b", "recompute=none"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches in flight" in out.split("worst rank:")[1]  # the first stage's 1F1B backlog


def test_advise_predict_picks_the_recompute_for_the_recipes_cluster(capsys):
    from recipes.analyze.advise import main

    assert main(["--predict", "recipe=deepseek_v3"]) == 0  # budget: the recipe's GPU
    out = capsys.readouterr().out
    assert "budget 77.00 GiB" in out and "Recompute alone: recompute=full" in out
    assert "Plan over recompute x offload" in out and "choice:    recompute=" in out  # recompute and offload


def _slurm_dry_run(tmp_path, *overrides):
    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "train.py", "-m", "launcher=slurm", "hydra.launcher.partition=gpu",
                           "hydra.launcher.cpus_per_task=64", "dry_run=true", f"hydra.sweep.dir={tmp_path}",
                           *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_recipe_slurm_submission_for_its_published_nodes(tmp_path):
    """The published layout's node count, one controller per node, torchrun with 8 processes on each."""
    proc = _slurm_dry_run(tmp_path, "recipe=deepseek_v3", "recipe.full_depth=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    script = (tmp_path / "slurm_dry_run.sbatch").read_text()
    for line in ("#SBATCH --nodes=32", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"):
        assert line in script
    assert "recipe=deepseek_v3: TP2 PP8 EP32 SP on 32 node(s) x 8 = 256 processes, 61 layers" in proc.stdout
    assert "torch.distributed.run --nproc-per-node=8 --nnodes=32 --node-rank=$SLURM_NODEID" in proc.stdout
    assert not list(tmp_path.glob("*/result.json"))  # nothing ran


@pytest.mark.parametrize("overrides,option", [
    (["recipe=qwen3_next_80b_a3b"], "recipe.full_depth"),  # reduced depth is not a cluster job
    (["recipe=qwen3_next_80b_a3b", "recipe.full_depth=true", "parallel.expert_model_parallel_size=64"],
     "parallel.expert_model_parallel_size"),  # 64 does not divide the 32-GPU cluster's expert layout
])
def test_bad_recipe_submissions_are_refused_before_submitting(tmp_path, overrides, option):
    proc = _slurm_dry_run(tmp_path, *overrides)
    assert proc.returncode == 2 and f"{option}:" in proc.stderr and "fix:" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "slurm_dry_run.sbatch").exists()


def test_a_recipe_run_is_named_after_the_recipe():
    """A recipe sets the model, so its runs (console, report rows, W&B) carry the recipe's name, not the
    default model group's."""
    from omegaconf import OmegaConf

    from recipes.config import compose_config
    from recipes.run.controller import run_name

    cfg = OmegaConf.create(compose_config(["recipe=qwen3_next_80b_a3b"]))
    choices = {"model": "standard_attn", "attention": "sdpa", "recipe": "qwen3_next_80b_a3b"}
    assert run_name(cfg, choices).startswith("qwen3_next_80b_a3b sdpa ")
    assert run_name(cfg, {**choices, "recipe": None}).startswith("standard_attn sdpa ")
