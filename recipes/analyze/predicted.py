"""Advice before any run: every recompute option of a configuration ranked by its predicted peak per
rank (``recipes.predict.estimate``), the one that replays the least work among those that fit, and
the plan over recompute x offload (``recipes.analyze.plan``), with the sweep that confirms it.

    python -m recipes advise --budget-gib 40 --predict model=moe size=h200
"""

from __future__ import annotations

from dataclasses import replace

from recipes.analyze.plan import explain_plan, fewest_block_layers, overrides_of, plan
from recipes.config import typed
from recipes.files import GIB
from recipes.hardware import check_budget, resolve_profile
from recipes.measure.flops import layer_forward_flops, replayed_layer_flops
from recipes.predict.estimate import predict_options
from recipes.predict.estimate_command import routing_line
from recipes.predict.fit import FITS, TIGHT, slack_for, verdict
from recipes.recipe import at_full_depth, compose_recipe
from recipes.recompute import NO_RECOMPUTE, guide_order, recompute_config


def advise_before_running(overrides: list[str], budget_gib: float) -> dict:
    """PREDICTED advice, before any run: every option of the family by recipes.predict.estimate's peak per
    rank; the choice is the fitting option that replays the least forward work (recipes.measure.flops),
    no recompute first: the guide's "narrowest boundary that fits", to be confirmed by a sweep."""

    cfg, _ = compose_recipe(at_full_depth(overrides), on_gpu=True)  # recipe=<name>: its published layout
    cfg = typed(cfg)
    profile, why = resolve_profile(cfg)
    check_budget(budget_gib, profile)
    done, refused = predict_options(cfg, "cuda")
    layer = layer_forward_flops(cfg)
    per_layer = sum(layer.get(k, 0.0) for k in ("attn_proj", "core_attn", "mlp", "moe"))
    rows = []
    for option, p in done:
        rc = replace(cfg.recompute, **recompute_config(option))
        if option == "full/block":
            rc, p = fewest_block_layers(cfg, rc, budget_gib)
        replay = replayed_layer_flops(replace(cfg, recompute=rc), layer, per_layer)
        peak, slack = p["peak_bytes"] / GIB, p["allocator_slack"]
        rows.append({"recompute": option, "predicted_peak_gib": peak, "fits": verdict(peak, budget_gib, slack) == FITS,
                     "tight": verdict(peak, budget_gib, slack) == TIGHT,
                     "replay_fraction": replay / per_layer,
                     **({"recompute_num_layers": rc.recompute_num_layers} if option == "full/block" else {})})
    rows.sort(key=lambda r: r["predicted_peak_gib"])
    fitting = [r for r in rows if r["fits"]]
    family = cfg.model.family
    choice = min(fitting, key=lambda r: (r["replay_fraction"], guide_order(r["recompute"], family)), default=None)
    share = done[0][1]["routed_share"] if done else None
    return {"source": "predicted", "budget_gib": budget_gib, "overrides": overrides, "family": family, "options": rows,
            "allocator_slack": slack_for(cfg), "routed_share": share,
            "choice": choice, "refused": [{"recompute": o, "why": w} for o, w in refused],
            "profile": profile.name, "profile_text": profile.describe(), "profile_why": why,
            "cuda_reserved_gib": profile.cuda_reserved_gib, "gpu": profile.gpu,
            "plan": plan(cfg, budget_gib, profile=profile)}


def recipe_budget(overrides: list[str]) -> float | None:
    """The allocator budget of a named recipe's GPU (or ``cluster.gpu``'s): its hardware profile's
    (``recipes.hardware``), else None."""
    if not any(o.startswith(("recipe=", "cluster.gpu=")) for o in overrides):
        return None
    cfg, _ = compose_recipe(at_full_depth(overrides), on_gpu=True)
    return resolve_profile(cfg)[0].budget_gib


def explain_prediction(advice: dict) -> str:
    lines = [f"PREDICTED (recipes.predict.estimate, nothing measured) for {' '.join(advice['overrides']) or 'the defaults'}, "
             f"budget {advice['budget_gib']:.2f} GiB per GPU for PyTorch's allocator (a GPU's capacity less what CUDA "
             f"and its libraries hold: {advice['cuda_reserved_gib']:g} GiB on the {advice['gpu']}; profile "
             f"{advice['profile']}, {advice['profile_why']}). Peak allocated; fits = with {advice['allocator_slack']:.1%} "
             "allocator slack on top, tight = only without it:"]
    routing = routing_line(advice)
    lines += [routing] if routing else []
    for r in advice["options"]:
        mark = "fits" if r["fits"] else "tight" if r.get("tight") else "over"
        name = r["recompute"] + (f" ({r['recompute_num_layers']} layers)" if r.get("recompute_num_layers") else "")
        lines.append(f"  {name:<34} {r['predicted_peak_gib']:8.2f} GiB  {mark}  "
                     f"replays {r['replay_fraction']:.0%} of a layer's forward")
    c = advice["choice"]
    lines += explain_plan(advice.get("plan"), " ".join(advice["overrides"]))
    if c:
        runner = min((r for r in advice["options"] if r["fits"] and r is not c  # control is none with hooks
                      and not {r["recompute"], c["recompute"]} <= set(NO_RECOMPUTE)),
                     key=lambda r: (r["replay_fraction"], guide_order(r["recompute"], advice.get("family"))),
                     default=None)
        lines.append(f"Recompute alone: {overrides_of(c)} (predicted {c['predicted_peak_gib']:.2f} GiB, the "
                     "fitting option that replays the least work" + (
                         f"; runner-up {overrides_of(runner)}, replays {runner['replay_fraction']:.0%})."
                         if runner else ")."))
    else:
        near = min(advice["options"], key=lambda r: r["predicted_peak_gib"], default=None)
        lines.append("Nothing is predicted to fit" + (f"; closest: {near['recompute']} at "
                     f"{near['predicted_peak_gib']:.2f} GiB" if near else "") + ": more parallelism "
                     "(tensor + sequence, pipeline, expert), a smaller micro-batch or sequence.")
    lines.append(f"With the micro-batch size too (global batch fixed): python -m recipes plan --budget-gib "
                 f"{advice['budget_gib']:g} {' '.join(advice['overrides'])}")
    return "\n".join(lines)
