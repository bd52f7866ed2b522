"""The import graph of src/marlflow has no cycle, every import goes down the floors of LAYERS (never up, never
sideways into another package of the same floor), the run-reading modules import no command-line module, and
no function in src/marlflow is over MAX_FUNCTION_LINES lines.

Every `import` / `from ... import` anywhere in a module counts, at module level or inside a function (a lazy
import still ties the two modules together), with relative imports resolved. `from pkg import name` counts as
an import of `pkg.name` when that is a module, and of `pkg` itself. A module's import of one of its own
ancestor packages (`marlflow.workflows.voting` importing `marlflow.workflows`) is not an edge: Python runs a
package's `__init__` before any submodule anyway, so that dependency exists whatever the code says, and a
package that registers its submodules (workflows, tasks) is the usual shape of a registry, not a circle.
Run: `pytest -q tests/test_imports.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# Modules that parse command lines and drive a whole command; library modules must not need them.
CLI_MODULES = {"marlflow.__main__", "marlflow.cli"} | {
    f"marlflow.cli.{p.stem}" for p in (SRC / "marlflow/cli").glob("*.py")
}
# The package's floors, lowest first: a module may import its own package and packages on lower floors.
# Each package's __init__ docstring says what lives there; docs/architecture.md explains the order.
LAYERS = (
    ("store", "sandbox"),  # files on disk, atomic writers; the sandbox for model-written code
    ("core",),  # RunConfig, WorkflowSpec, GRPO math, metric definitions, pure statistics
    ("tasks",),  # problems, datasets, rewards
    ("generation",),  # sampling, HF / fastgen / vLLM backends
    ("workflows",),  # single, eval_opt, voting, orch_workers (episodes over a backend)
    ("models",),  # loading, the toy build, run folders
    ("interventions",),  # what an intervention changes in the loss or the loop
    ("training",),  # the GRPO step and what keeps a run alive
    ("pipeline",),  # matrix.yaml -> run sheet, the planner, Snakemake helpers
    ("analysis",),  # tables, claims, figures (downstream of runs only)
    ("report",),  # the HTML report
    ("cli",),  # every command
)
# Top-level modules: the package root holds only __version__; __main__ is the `python -m marlflow` command.
TOP_LEVEL = {"marlflow": 0, "marlflow.__main__": len(LAYERS)}
# A function longer than this (its `def` line to its last line, nested functions included) is split.
MAX_FUNCTION_LINES = 80
# The only exception, with its length now: toybuild.py's bytes are hashed into the shipped toy model's
# version (src/marlflow/models/toy_model), so splitting build_toy would make the shipped model stale.
LONG_FUNCTIONS = {"marlflow.models.toybuild.build_toy": 83}


def modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package __init__)} of every .py file under src/marlflow."""
    out = {}
    for path in sorted((src / "marlflow").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """{module: the marlflow modules it imports anywhere in its text}, ancestor packages left out."""
    mods = modules(src)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        package = name.split(".") if is_pkg else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets.add(module)
                targets.update(f"{module}.{a.name}" for a in node.names)
        edges = set()
        for t in targets:
            while t and t not in mods:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                edges.add(t)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, deterministic order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def floor_of(module: str) -> int:
    """The floor (index into LAYERS) of a marlflow module; KeyError names a package LAYERS does not place."""
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    package = module.split(".")[1]
    for i, floor in enumerate(LAYERS):
        if package in floor:
            return i
    raise KeyError(
        f"{module}: package {package!r} is on no floor of LAYERS (tests/test_imports.py): place it"
    )


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every edge that goes up a floor, or across to another package on the same floor."""
    bad = []
    for mod, targets in sorted(graph.items()):
        for t in sorted(targets):
            same_package = mod.split(".")[:2] == t.split(".")[:2]
            if not same_package and (
                floor_of(t) > floor_of(mod) or (floor_of(t) == floor_of(mod) and t != "marlflow")
            ):
                bad.append(f"{mod} (floor {floor_of(mod)}) imports {t} (floor {floor_of(t)})")
    return bad


def test_imports_go_down_the_floors():
    assert not layer_violations(import_graph()), "imports against LAYERS:\n" + "\n".join(
        layer_violations(import_graph())
    )


def test_every_package_is_on_a_floor_and_says_what_it_may_import():
    for name, (path, is_pkg) in modules().items():
        floor_of(name)
        if is_pkg and name.count(".") == 1:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert doc, f"{path}: a package says in its docstring what lives there"


def test_the_layer_check_sees_an_upward_and_a_sideways_import(tmp_path):
    """The checker itself: training importing analysis (up), and store importing sandbox (same floor)."""
    pkg = tmp_path / "marlflow"
    for sub in ("training", "analysis", "store", "sandbox", "core"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "training" / "loop.py").write_text("def f():\n    from marlflow.analysis import x\n")
    (pkg / "analysis" / "x.py").write_text("from marlflow.core import y\n")
    (pkg / "core" / "y.py").write_text("import marlflow\n")
    (pkg / "store" / "w.py").write_text("from marlflow.sandbox import z\n")
    (pkg / "sandbox" / "z.py").write_text("")
    bad = layer_violations(import_graph(tmp_path))
    assert bad == [
        "marlflow.store.w (floor 0) imports marlflow.sandbox (floor 0)",
        "marlflow.store.w (floor 0) imports marlflow.sandbox.z (floor 0)",
        "marlflow.training.loop (floor 7) imports marlflow.analysis (floor 9)",
        "marlflow.training.loop (floor 7) imports marlflow.analysis.x (floor 9)",
    ], bad


def test_run_reading_modules_import_no_cli_module():
    graph = import_graph()
    for lib in (
        "marlflow.models.runs",
        "marlflow.training.final",
        "marlflow.training.checkpoint",
        "marlflow.models.loading",
    ):
        bad = reachable(graph, lib) & CLI_MODULES
        assert not bad, f"{lib} imports the command-line module(s) {sorted(bad)}, directly or through others"


def test_the_graph_sees_lazy_relative_and_from_imports(tmp_path):
    """The checker itself: a circle made only of a function-level relative import is found."""
    pkg = tmp_path / "marlflow"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text(
        "from marlflow.sub import a\n"
    )  # the registry shape: no edge back
    (pkg / "sub" / "a.py").write_text("from marlflow import sub\nfrom marlflow.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.a import g\n")
    graph = import_graph(tmp_path)
    assert graph["marlflow.sub.a"] == {"marlflow.b"} and graph["marlflow.b"] == {"marlflow.sub.a"}
    assert find_cycle(graph) == ["marlflow.b", "marlflow.sub.a", "marlflow.b"]
    del graph["marlflow.b"]
    assert find_cycle(graph) is None


def function_lengths(src: Path = SRC) -> dict[str, int]:
    """{module.qualified.name: lines from its `def` to its last line} of every function under src/marlflow."""
    out = {}
    for name, (path, _) in modules(src).items():

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    qual = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        out[qual] = child.end_lineno - child.lineno + 1
                    visit(child, qual)
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(), str(path)), name)
    return out


def test_no_function_is_over_max_lines():
    lengths = function_lengths()
    long = {f: n for f, n in lengths.items() if n > MAX_FUNCTION_LINES and n > LONG_FUNCTIONS.get(f, 0)}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"
    # An exception that no longer exists, or shrank, must not keep room for new lines.
    for f, n in LONG_FUNCTIONS.items():
        assert lengths.get(f) == n, f"{f} is {lengths.get(f)} lines now: update LONG_FUNCTIONS"


def test_the_length_check_sees_methods_and_nested_functions(tmp_path):
    """The checker itself: a long method and a long nested function are measured under their own names."""
    (tmp_path / "marlflow").mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(85))
    (tmp_path / "marlflow" / "m.py").write_text(
        f"class C:\n    def f(self):\n{body}\n\ndef g():\n    def h():\n{body}    return h\n"
    )
    lengths = function_lengths(tmp_path)
    assert lengths == {"marlflow.m.C.f": 86, "marlflow.m.g": 88, "marlflow.m.g.h": 86}
