"""The house: training -> model_export -> service, never the other way; no import cycle; functions
that fit on a screen; the service runs where torch, training and model_export are absent."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "training", "model_export", "shortlist")
FORBIDDEN_IN_SERVICE = {"torch", "training", "model_export", "onnx", "shortlist"}
# Longest function (lines, decorators excluded) per tree.
MAX_FUNCTION_LINES = {"service": 80, "training": 80, "model_export": 80, "shortlist": 80, "bench": 120}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Modules imported when this one runs (anywhere but under `if TYPE_CHECKING:`)."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return out


def _import_graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {_module_name(p): p for p in paths}
    graph = {}
    for name, path in modules.items():
        imports = _runtime_imports(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py")
        graph[name] = {m for m in imports if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles(_import_graph()) == []


def test_layers_point_one_way():
    # training -> model_export -> service: a package imports only its own and lower layers.
    rank = {"service": 0, "training": 1, "model_export": 2, "shortlist": 3}
    wrong = [f"{a} -> {b}" for a, deps in _import_graph().items() for b in deps
             if rank[b.split(".")[0]] > rank[a.split(".")[0]]]
    assert wrong == []


def test_the_engine_never_imports_the_api():
    # The engine (bundles, scoring, label changes) runs under any front end: the HTTP API, Ray
    # Serve, the CLI; the API is built on it, never the other way.
    wrong = [f"{a} -> {b}" for a, deps in _import_graph().items() for b in deps
             if a.startswith("service.engine") and b.startswith("service.api")]
    assert wrong == []


def test_service_sources_never_import_training_side_packages():
    offenders = []
    for path in (ROOT / "service").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN_IN_SERVICE]
    assert offenders == []


def test_functions_fit_on_a_screen():
    too_long = []
    for tree_name, limit in MAX_FUNCTION_LINES.items():
        for path in (ROOT / tree_name).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == []


def test_service_loads_and_predicts_with_torch_unavailable(bundle_root):
    # A None entry in sys.modules makes any import of that package fail, as if not installed.
    code = f"""
import sys
for name in {sorted(FORBIDDEN_IN_SERVICE)!r}:
    sys.modules[name] = None
from service.api import create_app
from service.api.settings import Settings
from service.engine import Predictor
create_app(Settings(bundle_root={str(bundle_root)!r}))
predictor = Predictor.load({str(bundle_root / "v1")!r})
print(len(predictor.predict(["hello world"], k=3)[0]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
