"""The dependency rules, read from the code's own imports (every import statement, at any
depth, so a lazy import inside a function counts too):

    server -> engine -> executor -> model -> _C;  kv/ and tokenizer/ are leaves.

- model/ imports nothing from engine/, executor/, server/ (nor kv.manager: block policy);
- executor/ nothing from engine/ or server/;
- engine/ nothing from model/ or server/: it reaches the model through the executor only;
- kv/, tokenizer/ and structured/ nothing from engine/, executor/, model/, server/;
- server/ reaches the engine through its public face only (the async engine, its outputs),
  never the core, the scheduler, the executor, the model or the KV cache;
- and no cycle between the packages."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyserve"
LAYERS = ("server", "engine", "executor", "model", "kv", "tokenizer", "structured")

FORBIDDEN = {
    "model": ("pyserve.engine", "pyserve.executor", "pyserve.server", "pyserve.kv.manager"),
    "executor": ("pyserve.engine", "pyserve.server"),
    "engine": ("pyserve.model", "pyserve.server"),
    "kv": ("pyserve.engine", "pyserve.executor", "pyserve.model", "pyserve.server"),
    "tokenizer": ("pyserve.engine", "pyserve.executor", "pyserve.model", "pyserve.server",
                  "pyserve.kv"),
    "structured": ("pyserve.engine", "pyserve.executor", "pyserve.model", "pyserve.server",
                   "pyserve.kv", "pyserve.tokenizer"),
    "server": ("pyserve.engine.core", "pyserve.engine.scheduler", "pyserve.engine.request",
               "pyserve.executor", "pyserve.model", "pyserve.kv"),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            # `from pyserve import _native` or `from pyserve.engine import core` name modules too
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "pyserve" or n.startswith("pyserve.")}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _all_imports() -> dict[str, set[str]]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): _imports(p)
            for p in PACKAGE.rglob("*.py")}


def test_each_layer_imports_only_downwards():
    problems = []
    for module, imported in sorted(_all_imports().items()):
        layer = _layer(module)
        for name in sorted(imported):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN.get(layer, ())):
                problems.append(f"{module} imports {name}")
    assert not problems, "\n".join(problems)


def test_no_cycle_between_packages():
    edges: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for module, imported in _all_imports().items():
        src = _layer(module)
        for name in imported:
            dst = _layer(name)
            if src and dst and src != dst:
                edges[src].add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges[start]:
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = [layer for layer in LAYERS if reaches(layer, layer, {layer})]
    assert not cycles, f"packages on a cycle: {cycles}; edges: {edges}"


def test_the_rules_see_real_imports():
    """The parser is not vacuous: it finds imports that are allowed and do exist."""
    imports = _all_imports()
    assert "pyserve.engine.async_engine" in imports["pyserve.server.openai.serving"]
    assert any(n.startswith("pyserve.model") for n in imports["pyserve.executor.shard"])
