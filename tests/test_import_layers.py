"""Every import of a tritune module points down the layer picture of shared/DESIGN.md (the CI check it asks for).

    cli ─► aot ─► user (the user-kernel API) ─► tuners ─► ops ─► store
                                                  │        └───► kernels
                                                  └──► tuning (the engine)

A layer may import its own modules and any layer below it (the picture's arrows, followed transitively). kernels/
import only themselves, `knobs` and `compile_target`; tuning/ only themselves, `knobs`, `device` (what the machine
is), `params` (`Config`, the value engine, tuners and stores share) and `compile_target` (what a compile process
answers Triton with: the engine's pool sets it, the persistent GEMM reads its SM count). The leaves `knobs`, `expr`,
`device`, `params` and `compile_target` import nothing of ours, and every other layer may import them. Imports
inside functions and under TYPE_CHECKING count: they are dependencies all the same. Source is parsed with `ast`,
nothing is imported, so the test takes well under a second.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "tritune"

# The picture's arrows: layer -> the layers directly below it.
BELOW: dict[str, tuple[str, ...]] = {
    "root": ("cli", "aot", "user", "tuners"),  # tritune/__init__.py: names whatever it exports or configures
    "cli": ("aot", "user", "tuners"),
    "aot": ("user", "tuners"),
    "user": ("tuners",),
    "tuners": ("ops", "tuning"),
    "ops": ("store", "kernels"),
    "store": (),
    "kernels": (),
    "tuning": (),
    "leaf": (),
}
LEAVES = {"tritune.knobs", "tritune.expr", "tritune.device", "tritune.params", "tritune.compile_target"}
ISOLATED = {"kernels": {"tritune.knobs", "tritune.compile_target"},
            "tuning": {"tritune.knobs", "tritune.device", "tritune.params", "tritune.compile_target"},
            "leaf": set()}  # the leaves these may import

# (importer, imported) pairs that break the rule and are still to be removed; the list may only shrink: a pair that
# no longer exists fails the test until it is deleted here. Empty: every import points down.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    """The layer a tritune module belongs to; a module the picture does not place fails here, by name."""
    if module == "tritune":
        return "root"
    if module in LEAVES:
        return "leaf"
    if module == "tritune.online_tune":
        return "tuners"  # the online tuning provider: runs tune_gemm / tune_fmoe for one missed shape
    top = module.split(".")[1]
    if top in ("cli", "aot", "user", "tuners", "ops", "store", "kernels", "tuning"):
        return top
    raise AssertionError(f"{module} has no layer: place it in tests/test_import_layers.py's layer_of")


def allowed(layer: str) -> set[str]:
    """The layer itself and every layer below it in the picture."""
    seen, todo = {layer}, list(BELOW[layer])
    while todo:
        below = todo.pop()
        if below not in seen:
            seen.add(below)
            todo.extend(BELOW[below])
    return seen


def imports_of(module: str, path: Path) -> set[str]:
    """The tritune modules `module` imports: `from tritune.x import y` names module tritune.x.y when that is a
    module, else tritune.x; relative imports are resolved."""
    known = modules()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tritune")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "tritune":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found - {module}


@cache
def violations() -> set[tuple[str, str]]:
    bad = set()
    for module, path in modules().items():
        layer = layer_of(module)
        for target in imports_of(module, path):
            target_layer = "leaf" if target in LEAVES else layer_of(target)
            if layer in ISOLATED:
                ok = (target_layer == layer != "leaf") or target in ISOLATED[layer]
            else:
                ok = target_layer == "leaf" or target_layer in allowed(layer)
            if not ok:
                bad.add((module, target))
    return bad


def test_every_module_has_a_layer():
    assert len(modules()) > 50  # the walk found the package
    for module in modules():
        layer_of(module)


def test_imports_point_down_the_layers():
    new = sorted(violations() - KNOWN_VIOLATIONS)
    assert not new, "imports against the layer order (shared/DESIGN.md):\n" + "\n".join(
        f"  {m} ({layer_of(m)}) imports {t} ({layer_of(t)})" for m, t in new)


def test_known_violations_only_shrink():
    gone = sorted(KNOWN_VIOLATIONS - violations())
    assert not gone, "fixed, so delete from KNOWN_VIOLATIONS:\n" + "\n".join(f"  {m} -> {t}" for m, t in gone)


def test_the_rule_itself():
    # Up the picture is refused, down it allowed; the engine is not below the ops; the import parser finds both.
    assert "tuners" not in allowed("ops") and "ops" in allowed("cli") and "tuning" not in allowed("ops")
    assert "aot" not in allowed("user") and "user" in allowed("aot")
    assert imports_of("tritune.user.api", modules()["tritune.user.api"]) >= {"tritune.user.keys",
                                                                             "tritune.tuning.tuner"}
