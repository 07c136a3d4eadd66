"""The package's shape: one home for the recompute vocabulary, imports that only point down, no circles."""

import ast
from pathlib import Path

import pytest
from conftest import REPO
from omegaconf import OmegaConf

from recipes import recompute

#: Lower layers never import higher ones: run -> analyze -> predict -> measure -> build/data -> base.
LAYERS = {
    "recipes": 0, "recipes.errors": 0, "recipes.files": 0, "recipes.recompute": 1, "recipes.config": 1, "recipes.offload": 1,
    "recipes.hardware": 1,
    "recipes.validate": 2, "recipes.results": 2, "recipes.recipe": 2,
    "launch": 3, "recipes.build": 3, "recipes.data": 3,
    "recipes.measure": 4, "recipes.predict": 5, "recipes.analyze": 6, "recipes.run": 7, "recipes.__main__": 8,
}


def _layer(module: str) -> int | None:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return LAYERS[best] if best else None


def _modules() -> dict[str, Path]:
    out = {}
    for path in list((REPO / "recipes").rglob("*.py")) + list((REPO / "launch").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found |= {n if n in MODULES else node.module for n in names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.split(".")[0] in ("recipes", "launch")}


MODULES = _modules()


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer(m) is None] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    up = [m for m in _imports(MODULES[module], top_level_only=False)
          if _layer(m) > _layer(module) and not m.startswith(module)]
    assert up == [], f"{module} (layer {_layer(module)}) imports a higher layer: {up}"


def test_no_import_circle():
    graph = {m: {i for i in _imports(p, top_level_only=False) if i in MODULES and i != m} for m, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_vocabulary_and_conf_recompute_agree():
    """Every label a conf/recompute/ file uses is in recipes.recompute.LABELS and vice versa."""
    used = set()
    for option in recompute.conf_options():
        cfg = OmegaConf.load(REPO / "conf" / "recompute" / f"{option}.yaml")
        used |= set(cfg.get("recompute_modules") or [])
        if cfg.recompute_granularity == "selective" and cfg.recompute_modules:
            assert option == "selective/" + "-".join(cfg.recompute_modules), f"{option}: its name is not its labels"
    assert used == set(recompute.LABELS)
    for family in recompute.FAMILIES:
        assert recompute.GUIDE_FIRST_LABEL[family] in recompute.options_for(family)


def test_options_per_family_follow_the_labels_families():
    assert "selective/mlp" not in recompute.options_for("moe")
    assert "selective/moe_act" in recompute.options_for("moe") and "selective/moe_act" not in recompute.options_for("mla")
    assert recompute.options_for("mla")[:2] == ["none", "control"] and recompute.options_for("mla")[-1] == "full/block"


def test_the_option_codec_round_trips():
    for option in recompute.conf_options():
        cfg = {"recompute": recompute.recompute_config(option)}
        assert recompute.option_of(cfg) == option
        labels = recompute.selective_labels(option)
        assert (labels is None) == recompute.is_full(option)
        assert labels is None or labels == frozenset(recompute.labels_of(cfg))
