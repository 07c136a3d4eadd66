"""The recipe x recompute table in docs/recipes.md, generated from the estimator.

For every named recipe (conf/recipe/) at its published layout and full depth, every applicable recompute
option's PREDICTED worst-rank peak (``recipes.predict.estimate.predict``: the pipeline stage with the
highest peak; every TP/DP/EP rank of a stage is predicted alike) and its verdict on an H100 80 GB and an
H200 141 GB (``recipes.predict.fit.verdict`` against ``recipes.recipe.GPU_BUDGET_GIB``), next to the
recompute the recipe's source publishes, and one sentence per recipe where the prediction and the
source disagree. Nothing here is measured.

    python tools/recipes_table.py          # rewrite the section between the markers
    python tools/recipes_table.py --check  # exit 1 if docs/recipes.md differs (make check-data)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: import the repository's recipes

import generated  # noqa: E402  (tools/, beside this script)
from generated import END, replace_section  # noqa: E402

from recipes.analyze.predicted import advise_before_running  # noqa: E402
from recipes.files import CONF_DIR, GIB  # noqa: E402
from recipes.predict.estimate import predict_options  # noqa: E402
from recipes.predict.fit import FITS, verdict  # noqa: E402
from recipes.recipe import GPU_BUDGET_GIB, GPU_NAME, at_full_depth, compose_recipe, layout_text  # noqa: E402

DOC = ROOT / "docs" / "recipes.md"
BEGIN = "<!-- BEGIN GENERATED: recipes -->"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))


def disagreement(name: str, cfg: dict, rows: dict[str, float], choice: str | None) -> str:
    """One sentence: does the published recompute agree with what the prediction picks for its GPU?"""
    recipe = cfg["recipe"]
    gpu, published = recipe["gpu"], recipe["published_recompute"]
    budget = GPU_BUDGET_GIB[gpu]
    peak = rows.get(published)
    if peak is None:
        return f"`{name}`: the published `{published}` is not an option this model has here."
    said = verdict(peak, budget)
    caveats = "; ".join(recipe["te_only"] + recipe["notes"])
    if said != FITS:
        return (f"`{name}`: disagree. The published `{published}` is predicted {said} on the {GPU_NAME[gpu]} "
                f"({peak:.1f} GiB worst rank against {budget:g}); "
                + (f"the prediction picks `{choice}`. " if choice else "nothing is predicted to fit. ")
                + f"Why they can differ: {caveats or 'the estimator models only what is listed in docs/estimate.md'}.")
    if choice and choice != published:
        return (f"`{name}`: the published `{published}` is predicted to fit ({peak:.1f} GiB on the {GPU_NAME[gpu]}), "
                f"but `{choice}` also fits and replays less forward work: the source keeps headroom the "
                f"estimator does not see" + (f" ({caveats})" if caveats else "") + ".")
    return f"`{name}`: agree: the published `{published}` is predicted to fit ({peak:.1f} GiB) and is the prediction's pick."


def section() -> str:
    lines = ["| recipe | recompute | worst-rank peak GiB | worst stage | H100 80 GB | H200 141 GB | published |",
             "|---|---|---|---|---|---|---|"]
    sentences = []
    for name in recipe_names():
        cfg, _ = compose_recipe(at_full_depth([f"recipe={name}"]), on_gpu=True)
        done, _ = predict_options(cfg, "cuda")
        published = cfg["recipe"]["published_recompute"]
        rows = {}
        for option, p in done:
            peak = p["peak_bytes"] / GIB
            rows[option] = peak
            lines.append(f"| `{name}` | `{option}` | {peak:.1f} | pp{p['worst_stage']} of {len(p['stages'])} | "
                         f"{verdict(peak, GPU_BUDGET_GIB['h100'])} | {verdict(peak, GPU_BUDGET_GIB['h200'])} | "
                         f"{'**published**' if option == published else ''} |")
        advice = advise_before_running([f"recipe={name}"], GPU_BUDGET_GIB[cfg["recipe"]["gpu"]])
        choice = advice["choice"]["recompute"] if advice["choice"] else None
        worst = next(p for option, p in done if option == (choice or done[0][0]))
        sentences.append(disagreement(name, cfg, rows, choice)
                         + f" Layout {layout_text(cfg)}; worst rank under `{choice or done[0][0]}`: {worst['worst_why']}.")
    intro = ("PREDICTED by `tools/recipes_table.py` (nothing measured). Budgets: what PyTorch's allocator may hold, "
             f"H100 {GPU_BUDGET_GIB['h100']:g} GiB and H200 {GPU_BUDGET_GIB['h200']:g} GiB; fits = with the "
             "allocator's slack, tight = only without it (`recipes.predict.fit.verdict`). Rows sorted by peak.")
    return "\n".join([intro, "", *lines, "", *[f"- {s}" for s in sentences]])


def render(text: str) -> str:
    if BEGIN not in text:
        text = text.rstrip("\n") + f"\n\n## Predicted peak per recipe and recompute option\n\n{BEGIN}\n{END}\n"
    return replace_section(text, BEGIN, section(), DOC)


def main(argv: list[str] | None = None) -> int:
    return generated.main(DOC, render, "is out of date with the recipes and the estimator: run "
                          "`python tools/recipes_table.py`", "the recipe table matches the estimator", "",
                          argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
