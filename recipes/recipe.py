"""Named recipes: a public architecture at its published layout, run here at reduced depth.

A ``conf/recipe/<name>.yaml`` file sets the published dimensions, vocabulary, parallel layout, batch and
recompute (each number cited in the file). ``apply_recipe`` runs after composition, in the controller and
in ``recipes.config.compose_config``:

- ``recipe.full_depth=true``: the config is the published one, every layer at the published layout (a
  cluster: ``launcher=slurm`` for more than one node). The estimator defaults to this.
- otherwise (the default for ``python train.py recipe=<name>``): the same per-layer shape at reduced depth
  (``recipe.reduced``, 4 layers unless the file says otherwise) in one process on this machine; on a
  machine without a GPU the widths are shrunk too (one layer of a real model does not fit a CPU run of
  seconds), keeping the layer pattern and the attention/MLP kinds. Both are printed.

The published layout is validated in both cases (``recipes.validate`` with no local GPU count), so a
layout that does not divide its cluster, a depth the pipeline stages cannot split, or a label the
architecture lacks is refused with the fix before anything starts.
"""

from __future__ import annotations

import copy

from recipes.errors import ConfigError
from recipes.recompute import MLP_KIND, moe_pattern
from recipes.validate import validate

#: What PyTorch's allocator may hold on each GPU a recipe names (GiB): the capacity less what CUDA and its
#: libraries keep outside the allocator (2.4 GiB measured on an H200: 139.8 -> 137; the same margin on an
#: H100 80 GB's 79.6 GiB gives 77). ``recipes.predict.fit.verdict`` judges predictions against these.
GPU_BUDGET_GIB = {"h100": 77.0, "h200": 137.0}
GPU_NAME = {"h100": "H100 80 GB", "h200": "H200 141 GB"}
#: Layers of the reduced-depth run unless the recipe says otherwise.
REDUCED_LAYERS = 4
#: The widths a reduced recipe runs with on a CPU (the tiny size's), per field.
CPU_WIDTHS = {"hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "kv_channels": None,
              "vocab_size": 512, "moe_ffn_hidden_size": 32, "kv_lora_rank": 32, "qk_head_dim": 16,
              "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}


def layout_text(cfg: dict) -> str:
    """``TP2 PP8 EP32 (SP) on 32 node(s) x 8 = 256 processes``."""
    par, launch = cfg["parallel"], cfg["launcher"]
    parts = [f"TP{par['tensor_model_parallel_size']}", f"PP{par['pipeline_model_parallel_size']}"]
    if par["virtual_pipeline_model_parallel_size"]:
        parts.append(f"VPP{par['virtual_pipeline_model_parallel_size']}")
    if par["context_parallel_size"] > 1:
        parts.append(f"CP{par['context_parallel_size']}")
    if par["expert_model_parallel_size"] > 1:
        parts.append(f"EP{par['expert_model_parallel_size']}")
    if par["sequence_parallel"]:
        parts.append("SP")
    world = launch["nproc_per_node"] * launch["nnodes"]
    return f"{' '.join(parts)} on {launch['nnodes']} node(s) x {launch['nproc_per_node']} = {world} processes"


def apply_recipe(cfg: dict, on_gpu: bool | None = None, overrides: list[str] = ()) -> tuple[dict, list[str]]:
    """(the config to run, notes to print). Unchanged without ``recipe=``; see the module docstring.
    ``overrides``: the command line's, refused where the recipe would replace them (``check_overrides``)."""
    recipe = cfg.get("recipe")
    if not recipe:
        return cfg, []
    name = recipe["name"]
    if on_gpu is None:
        from recipes.validate import gpu_count  # torch only where there is a GPU driver

        on_gpu = gpu_count() > 0
    if recipe["gpu"] not in GPU_BUDGET_GIB:
        raise ConfigError("recipe.gpu", f"unknown GPU {recipe['gpu']!r}", f"use one of {', '.join(GPU_BUDGET_GIB)}")
    published = copy.deepcopy(cfg)
    if published["launcher"]["nnodes"] > 1:  # a cluster's layout: torchrun on every node (launcher=slurm)
        published["launcher"]["name"] = "slurm"
    validate(published, num_gpus=0, te_available=False)  # the published layout, whatever runs here
    check_overrides(cfg, overrides, on_gpu)
    title = recipe["title"] or name
    notes = [f"recipe={name} needs Transformer Engine for {feature}; runs without it as noted in "
             f"conf/recipe/{name}.yaml" for feature in recipe["te_only"]]
    if recipe["full_depth"]:
        return cfg, [f"recipe={name}: {title} at full depth ({cfg['model']['num_layers']} layers), "
                     f"{layout_text(cfg)}"] + notes
    out = copy.deepcopy(cfg)
    m, full_layers = out["model"], cfg["model"]["num_layers"]
    reduced = dict(recipe["reduced"])
    n = reduced.pop("num_layers", REDUCED_LAYERS)
    if MLP_KIND[m["family"]] == "moe" and "moe_layer_freq" not in reduced:
        reduced["moe_layer_freq"] = moe_pattern(cfg["model"])[:n]  # the model's first n layers
    m.update(num_layers=n, **reduced)
    out["parallel"].update(tensor_model_parallel_size=1, sequence_parallel=False, pipeline_model_parallel_size=1,
                           virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
                           expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                           num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                           overlap_moe_expert_parallel_comm=False)
    out["launcher"].update(name="local", nproc_per_node=1, nnodes=1)
    out["train"]["global_batch_size"] = None
    changed = ", ".join(f"{k} {cfg['model'][k]} -> {v}" for k, v in reduced.items() if k != "moe_layer_freq")
    notes.insert(0, f"recipe={name}: {title} at reduced depth, {n} of {full_layers} layers with the same "
                    f"per-layer shape{f' ({changed})' if changed else ''}, in 1 process here; the published "
                    f"layout ({layout_text(cfg)}) runs with recipe.full_depth=true")
    if not on_gpu:
        shrunk = {k: v for k, v in CPU_WIDTHS.items() if m.get(k) is not None or k == "kv_channels"}
        heads, groups = m["num_attention_heads"], m["num_query_groups"]
        if groups:
            shrunk["num_query_groups"] = max(1, 4 // max(1, heads // groups))
        if m["q_lora_rank"]:
            shrunk["q_lora_rank"] = 32
        if m["num_moe_experts"]:
            shrunk.update(num_moe_experts=min(8, m["num_moe_experts"]), moe_router_topk=min(2, m["moe_router_topk"]))
        if m["moe_shared_expert_intermediate_size"]:
            shrunk["moe_shared_expert_intermediate_size"] = 64
        old = {k: m.get(k) for k in shrunk}
        m.update(shrunk)
        seq, mbs = out["train"]["seq_length"], out["train"]["micro_batch_size"]
        out["train"].update(seq_length=64, micro_batch_size=1)
        notes.append(f"recipe={name}: no GPU here, so the widths are shrunk as well (hidden {old['hidden_size']} "
                     f"-> 64, heads {heads} -> 4, vocab {old['vocab_size']} -> 512, experts "
                     f"{old.get('num_moe_experts') or '-'} -> {m['num_moe_experts'] or '-'}, sequence {seq} -> 64, "
                     f"micro-batch {mbs} -> 1): the layer pattern and attention/MLP kinds are the recipe's")
    return out, notes


#: Groups a recipe sets whole (its model, its layout): a choice of them would be overwritten.
RECIPE_GROUPS = ("model", "parallel")


def check_overrides(cfg: dict, overrides: list[str], on_gpu: bool) -> None:
    """Refuse a command-line override that the recipe would silently replace: a ``model=`` or ``parallel=``
    choice (the recipe sets both), and, at reduced depth, the depth, the layout, the launch and (on a
    machine without a GPU) the widths that ``apply_recipe`` sets."""
    recipe = cfg["recipe"]
    name, reduced = recipe["name"], not recipe["full_depth"]
    replaced = set()
    if reduced:
        replaced |= {"model.num_layers", "train.global_batch_size", "launcher.nproc_per_node", "launcher.nnodes"}
        replaced |= {f"model.{k}" for k in recipe["reduced"]} | {f"parallel.{k}" for k in cfg["parallel"]}
        if not on_gpu:
            replaced |= {f"model.{k}" for k in CPU_WIDTHS} | {"train.seq_length", "train.micro_batch_size"}
            replaced |= {f"model.{k}" for k in ("num_query_groups", "q_lora_rank", "num_moe_experts",
                                                "moe_router_topk", "moe_shared_expert_intermediate_size")}
    for override in overrides:
        key = str(override).lstrip("+~").split("=", 1)[0]
        if key in RECIPE_GROUPS:
            fix = ("change single fields with model.<field>=..., or run without recipe=" if key == "model" else
                   "its published layout runs with recipe.full_depth=true (parallel.<field>=... changes it there)")
            raise ConfigError(f"{key}={override.split('=', 1)[-1]}", f"recipe={name} sets the {key} itself, so this "
                              "choice would be overwritten", f"drop {key}=...; {fix}")
        if key in replaced:
            where = "at reduced depth" + ("" if on_gpu or key.startswith(("parallel", "launcher")) or key in (
                "model.num_layers", "train.global_batch_size") else " on a machine without a GPU")
            raise ConfigError(key, f"recipe={name} {where} sets {key} itself (recipes.recipe.apply_recipe), so this "
                              "override would be silently replaced", f"drop {key}, or add recipe.full_depth=true to "
                              "run the published layout with it (a cluster: launcher=slurm)")


def compose_recipe(overrides: list[str] = (), on_gpu: bool | None = None) -> tuple[dict, list[str]]:
    """``compose_config`` then ``apply_recipe``: what ``train.py`` runs for these overrides, and its notes."""
    from recipes.config import compose_config

    return apply_recipe(compose_config(overrides), on_gpu, overrides)


def at_full_depth(overrides: list[str]) -> list[str]:
    """The overrides with ``recipe.full_depth=true`` added when a recipe is named and its depth is not:
    predictions of a recipe are at its published layout unless asked otherwise (named as a Slurm launch,
    so a layout over several nodes validates: nothing is launched)."""
    overrides = list(overrides)
    named = any(o.startswith("recipe=") for o in overrides)
    if named and not any(o.startswith("recipe.full_depth") for o in overrides):
        overrides.append("recipe.full_depth=true")
    if named and not any(o.startswith("launcher") for o in overrides):
        overrides.append("launcher.name=slurm")  # a prediction launches nothing; the layout may span nodes
    return overrides
