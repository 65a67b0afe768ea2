"""The package's import graph: every module imports in a fresh interpreter, the graph of
``sky_flower`` modules (module-level and deferred imports alike) has no cycle, and only
the jobs, the Flower app glue and the benchmarks import the strategies (fast)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"sky_flower": ROOT / "sky_flower", "sky_flower.strategies": ROOT / "strategies"}
STRATEGY_USERS = ("sky_flower.jobs", "sky_flower.app", "sky_flower.bench")


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The sky_flower modules ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(f"{target}."):
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(n for n in _modules() if not n.endswith("__main__"))
    code = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module(n)"
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_import_graph_has_no_cycle():
    graph = _graph()
    assert graph["sky_flower.run"] >= {"sky_flower.jobs.common"}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_only_jobs_app_and_bench_import_the_strategies():
    for name, deps in _graph().items():
        if name.startswith("sky_flower.strategies") or name.startswith(STRATEGY_USERS):
            continue
        bad = sorted(d for d in deps if d.startswith("sky_flower.strategies"))
        assert not bad, f"{name} imports {bad}"
