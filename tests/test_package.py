"""Package-wide structure: the pinned public API, no import cycles, no private names across modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import trainfit

SRC = Path(trainfit.__file__).parent


def test_public_api_is_pinned() -> None:
    assert sorted(trainfit.__all__) == sorted(
        [
            "InferenceReport",
            "MemoryReport",
            "Strategy",
            "TrainfitError",
            "__version__",
            "estimate",
            "get_gpu",
            "infer",
            "load_model",
            "trace",
        ]
    )
    for name in trainfit.__all__:
        assert getattr(trainfit, name) is not None
    assert callable(trainfit.estimate) and callable(trainfit.trace)


def test_public_api_imports_no_torch() -> None:
    code = (
        "import sys; from trainfit import estimate, trace, load_model, get_gpu, Strategy, MemoryReport; "
        "print(any(m in sys.modules for m in ('torch', 'transformers', 'huggingface_hub')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _module_level_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Imports executed when the module is imported (not inside functions, not under TYPE_CHECKING)."""
    out: list[ast.ImportFrom | ast.Import] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                out.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)

    visit(tree.body)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in _module_level_imports(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.module:
                base = node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if t in modules and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return cycles


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = _graph()
    assert graph.get("trainfit.analytic.model")  # the graph is real
    cycles = find_cycles(graph)
    assert not cycles, cycles[:5]


def test_no_private_names_imported_across_modules() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainfit"):
                for alias in node.names:
                    target = SRC.parent.joinpath(*f"{node.module}.{alias.name}".split(".")).with_suffix(".py")
                    own_private_module = target.exists() and _module_name(path).startswith(node.module)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and not own_private_module:
                        offenders.append(f"{_module_name(path)} imports {node.module}.{alias.name}")
    assert not offenders, offenders


def test_trace_and_measure_do_not_import_the_analytic_model() -> None:
    """What the two methods share lives in cuda_facts, fsdp_units, overhead and strategy (docs/architecture.md)."""
    graph = _graph()
    offenders = [
        (m, n)
        for m, deps in graph.items()
        if m.startswith(("trainfit.trace", "trainfit.measure"))
        for n in deps
        if n.startswith("trainfit.analytic")
    ]
    assert not offenders, offenders
