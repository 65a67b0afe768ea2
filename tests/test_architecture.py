"""Layout rules (issues 12 and 29), checked on the source tree (fast, no Flower started).

(a) the pure core (``sky_flower.core``, ``sky_flower.pipeline``) imports no ``flwr`` and
no ``hydra``; (b) no import cycles among ``sky_flower`` modules (function-level imports
included); (c) only the entry points import ``sky_flower.strategies``; (d) boundaries:
imports between packages go one way. ``sky_flower.core`` imports nothing from
``sky_flower.pipeline``; in ``sky_flower.sky`` no transport runner (``relay``,
``direct``, ``stream``) imports another (they share ``transport.runner``, ``hops``,
``guard``, ``deadlines``), node code (``sky.node``) and planning (``sky.planning``)
import nothing from round control (``sky.rounds``), the transports nothing from planning
or round control, and at most six modules sit at the top of ``sky_flower/sky/`` (what
both halves share: the protocol, optimizer-state migration, the settings). Every rule
is checked on the import graph built here (``GRAPH``, function-level imports included),
and a failure names the offending ``importer -> imported`` edge. (e) The strategy's
parts (issue 43: ``sky.rounds`` ``joins``, ``planner``, ``executor``, ``recovery``)
import no other part and not the strategy, are built with no bound method of another
part or of the strategy, and only the strategy (``strategies/sky.py``) imports the run
state or writes its fields.

There is no line limit: a module is split when it holds two concepts, not when it
crosses a number (a review habit, not a test).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"sky_flower": ROOT / "sky_flower", "sky_flower.strategies": ROOT / "strategies"}
PURE_PACKAGES = ("sky_flower.core", "sky_flower.pipeline")
FORBIDDEN_IN_PURE = ("flwr", "hydra")
# modules (or packages, by prefix) allowed to import sky_flower.strategies
STRATEGY_IMPORTERS = ("sky_flower.app", "sky_flower.jobs", "sky_flower.bench", "sky_flower.run")
SKY = "sky_flower.sky"
# the runners of sky_flower.sky.transport; the package's other modules are what they share
TRANSPORTS = ("relay", "direct", "stream")
MAX_SKY_TOP_MODULES = 6


# -- the module graph -------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for sky_flower and its strategies."""
    out = {}
    for pkg, base in PACKAGE_DIRS.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """The sky_flower modules ``name`` imports, anywhere in its body (not the parent
    packages that Python imports on the way, not imports for type checkers only)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    here = name if _is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    typing_only = {  # ``if TYPE_CHECKING:`` imports never run
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for sub in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` mod
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # ``import a.b.c`` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return sorted(out)


def _cycle_path(comp: list[str]) -> str:
    """One cycle through the component, as ``a -> b -> ... -> a``."""
    members = set(comp)
    start = comp[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(GRAPH[path[-1]] & members)
        back = [w for w in nxt if w in seen]
        if back:
            w = back[0]
            return " -> ".join([*path[path.index(w) :], w])
        path.append(nxt[0])
        seen.add(nxt[0])


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# -- (a) the pure core, and every module importable ---------------------------------------
# One fresh interpreter serves both checks (each used to start its own: torch and Flower
# imported twice): it imports the pure core alone and reports what that pulled in, then
# imports every other module.
@pytest.mark.processes
def test_pure_core_imports_no_flower_and_no_hydra_and_every_module_imports():
    """(a) The pure core, imported alone in a fresh interpreter, imports no ``flwr`` and
    no ``hydra``; then every module imports in that same fresh interpreter (the pure
    core first, the rest in sorted order)."""
    pure = sorted(n for n in MODULES if n.startswith(PURE_PACKAGES))
    assert "sky_flower.core.partition.optimal" in pure and "sky_flower.pipeline.direct" in pure
    names = sorted(n for n in _modules() if not n.endswith("__main__"))
    code = (
        "import importlib, sys\n"
        f"for m in {pure!r}:\n"
        "    importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN_IN_PURE!r})\n"
        "print('pure core imports: ' + ' '.join(bad), flush=True)\n"
        "for n in sys.argv[1:]: importlib.import_module(n)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, cwd=ROOT
    )
    first = done.stdout.splitlines()[:1]
    assert first, f"the pure core failed to import: {done.stderr[-3000:]}"
    assert first[0] == "pure core imports: ", f"the pure core imported {first[0][19:]}"
    assert done.returncode == 0, done.stderr[-3000:]


# -- (b) no import cycles ---------------------------------------------------------------
def test_graph_sees_function_level_and_relative_imports():
    assert "sky_flower.core.cost" in GRAPH["sky_flower.core.partition.plan"]
    assert "sky_flower.core.partition.heuristic" in GRAPH["sky_flower.core.partition.optimal"]
    # an import inside a function
    assert "sky_flower.strategies.decentralized" in GRAPH["sky_flower.jobs.decentralized"]


def test_no_import_cycles():
    found = _cycles()
    assert not found, "import cycles: " + "; ".join(_cycle_path(c) for c in found)


# -- (c) who imports the strategies -----------------------------------------------------
def _strategy_importers() -> list[str]:
    return sorted(
        n
        for n, deps in GRAPH.items()
        if not n.startswith("sky_flower.strategies")
        and any(d.startswith("sky_flower.strategies") for d in deps)
    )


def _allowed_strategy_importer(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in STRATEGY_IMPORTERS)


def test_only_entry_points_import_the_strategies():
    bad = [n for n in _strategy_importers() if not _allowed_strategy_importer(n)]
    assert not bad, f"modules importing sky_flower.strategies: {bad}"


# -- (d) boundaries between packages -----------------------------------------------------
def _edges(importers: str, imported: str) -> list[str]:
    """Every ``a -> b`` import from a module under ``importers`` to one under ``imported``
    (dotted prefixes), sorted: what a failing boundary names."""

    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return sorted(
        f"{a} -> {b}"
        for a, deps in GRAPH.items()
        if under(a, importers)
        for b in deps
        if under(b, imported)
    )


def test_edges_name_the_offending_import():
    assert "sky_flower.core.partition.plan -> sky_flower.core.cost" in _edges(
        "sky_flower.core.partition", "sky_flower.core.cost"
    )


def test_core_imports_nothing_from_pipeline():
    """The planning core is pure arithmetic on profiles; the torch pipeline builds on it,
    never the other way round."""
    bad = _edges("sky_flower.core", "sky_flower.pipeline")
    assert not bad, "sky_flower.core imports sky_flower.pipeline: " + "; ".join(bad)


def test_the_sky_packages_exist():
    """The rules below name these packages: a rename must update them, not void them."""
    for pkg in ("node", "transport", "planning", "rounds"):
        assert _is_package(f"{SKY}.{pkg}"), f"{SKY}.{pkg} is gone: update the rules"
    for name in TRANSPORTS:
        assert f"{SKY}.transport.{name}" in MODULES


def test_no_transport_imports_another():
    """Each runner imports only the shared modules of ``sky.transport`` (the runner
    interface, ``hops``, ``guard``, ``deadlines``, the stream's data plane)."""
    bad = [
        edge
        for a in TRANSPORTS
        for b in TRANSPORTS
        if a != b
        for edge in _edges(f"{SKY}.transport.{a}", f"{SKY}.transport.{b}")
    ]
    assert not bad, "a transport imports a sibling transport: " + "; ".join(bad)


def test_node_side_imports_nothing_from_round_control():
    bad = _edges(f"{SKY}.node", f"{SKY}.rounds")
    assert not bad, "node code imports round control: " + "; ".join(bad)


def test_planning_imports_nothing_from_round_control():
    bad = _edges(f"{SKY}.planning", f"{SKY}.rounds")
    assert not bad, "planning imports round control: " + "; ".join(bad)


def test_transports_import_nothing_from_planning_or_round_control():
    bad = _edges(f"{SKY}.transport", f"{SKY}.planning") + _edges(
        f"{SKY}.transport", f"{SKY}.rounds"
    )
    assert not bad, "a transport imports planning or round control: " + "; ".join(bad)


def test_sky_has_at_most_six_top_level_modules():
    """``sky_flower/sky/`` holds what both halves share at its top; the rest is in its
    packages by concept."""
    top = sorted(
        n
        for n in MODULES
        if n.startswith(SKY + ".") and n.count(".") == SKY.count(".") + 1 and not _is_package(n)
    )
    assert len(top) <= MAX_SKY_TOP_MODULES, (
        f"{len(top)} modules at the top of {SKY} (at most {MAX_SKY_TOP_MODULES}): {top}"
    )


# -- (e) the strategy's parts: values in, values out; one writer of the run state --------
ROUNDS = f"{SKY}.rounds"
PARTS = ("joins", "planner", "executor", "recovery")  # Benchmarker, Planner, executor, Recovery
PART_CLASSES = ("Benchmarker", "Planner", "RoundExecutor", "Recovery", "Evaluator")
STRATEGY = "sky_flower.strategies.sky"
STATE = f"{ROUNDS}.state"
# calls that change a list, dict or set in place
MUTATORS = {
    "append",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "clear",
    "update",
    "add",
    "discard",
    "setdefault",
    "sort",
    "reverse",
}


def test_the_parts_exist():
    """The rules below name these modules: a rename must update them, not void them."""
    for name in PARTS:
        assert f"{ROUNDS}.{name}" in MODULES, f"{ROUNDS}.{name} is gone: update the rules"
    assert STATE in MODULES and STRATEGY in MODULES


def test_no_part_imports_another_part_or_the_strategy():
    """A part is handed what it needs and returns what it found: it never reaches into
    another part, nor into the strategy that runs them."""
    bad = [
        edge
        for a in PARTS
        for b in PARTS
        if a != b
        for edge in _edges(f"{ROUNDS}.{a}", f"{ROUNDS}.{b}")
    ]
    bad += [edge for a in PARTS for edge in _edges(f"{ROUNDS}.{a}", "sky_flower.strategies")]
    assert not bad, "a part imports another part or the strategy: " + "; ".join(bad)


def test_only_the_strategy_imports_the_run_state():
    bad = [e for e in _edges("sky_flower", STATE) if not e.startswith(STRATEGY + " ")]
    assert not bad, "the run state is imported outside the strategy: " + "; ".join(bad)


def _state_fields() -> set[str]:
    """The fields of ``RunState`` (its annotated class attributes)."""
    tree = ast.parse(MODULES[STATE].read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunState"]
    return {
        stmt.target.id
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def _is_state(node: ast.expr) -> bool:
    """``state``, ``st``, ``<anything>.state``: an expression that names a run state."""
    if isinstance(node, ast.Name):
        return node.id in ("state", "st")
    return isinstance(node, ast.Attribute) and node.attr == "state"


def _field_of_state(node: ast.expr, fields: set[str]) -> str | None:
    """``state.<field>`` (or ``state.<field>[k]``): the field, else None."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in fields and _is_state(node.value):
        return node.attr
    return None


def _state_writes(source: str, fields: set[str]) -> list[str]:
    """Every write to a run-state field in ``source``: assigned (``st.rounds = ...``,
    ``st.ids[k] = ...``, ``+=``, ``del``) or changed in place (``st.joins.append(...)``),
    as ``line: code``."""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            targets = [node.func.value]
        flat = [t for tgt in targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        if any(_field_of_state(t, fields) for t in flat):
            out.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def test_state_writes_are_found():
    fields = _state_fields()
    assert {"rounds", "node_profiles", "ids", "joins"} <= fields
    code = (
        "st.rounds.append(r)\nself.state.node_profiles = []\nstate.ids[n] = 1\n"
        "st.a, st.joins = 1, []\nout.joins.append(j)\nx = st.rounds\n"
    )
    assert sorted(int(w.split(":")[0]) for w in _state_writes(code, fields)) == [1, 2, 3, 4]


def test_only_the_strategy_writes_the_run_state():
    """The strategy's loop is the one writer of the run's state: no other module assigns
    a ``RunState`` field or changes one in place."""
    fields = _state_fields()
    bad = [
        f"{_rel(path)}:{w}"
        for name, path in MODULES.items()
        if name != STRATEGY
        for w in _state_writes(path.read_text(), fields)
    ]
    assert not bad, "the run state is written outside the strategy: " + "; ".join(bad)


def test_parts_are_built_without_callbacks():
    """``SkyStrategy`` builds its parts from values (settings, schedule, model): no
    argument is a bound method of the strategy or of another part (``self.x.y``)."""
    tree = ast.parse(MODULES[STRATEGY].read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SkyStrategy"]
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    bad = []
    for node in ast.walk(cls):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) in PART_CLASSES):
            continue
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            text = ast.unparse(arg)
            chain = text.split(".")
            if chain[0] == "self" and (len(chain) > 2 or chain[-1] in methods):
                bad.append(f"{ast.unparse(node.func)}(... {text} ...)")
    assert not bad, "a part is handed a bound method: " + "; ".join(bad)


def test_hooks_receive_typed_events_not_documents():
    """Every ``SkyHooks`` point but ``on_evaluate`` takes one frozen event dataclass
    (its ``to_dict()`` is the JSON a writer wants), not a dict or the strategy."""
    import dataclasses
    import typing

    from sky_flower.sky.rounds import hooks

    points = [n for n in vars(hooks.SkyHooks) if n.startswith("on_") and n != "on_evaluate"]
    assert len(points) == 5
    for name in points:
        event = typing.get_type_hints(getattr(hooks.SkyHooks, name), vars(hooks))["event"]
        assert dataclasses.is_dataclass(event) and event.__dataclass_params__.frozen, name
