"""The import rules of docs/architecture.md, read off the source (every ``import``, at module
level or inside a function) so that they stay true.

1. No module imports itself back through others, and no room (a top-level module or package of
   ``trainperf``) imports itself back through other rooms.
2. Floors: a room imports only rooms on its own floor or below (``FLOORS``).
3. The runner imports no framework: importing it (and the planning above it) loads none.
4. A framework's worker imports only its framework, numpy, the standard library, its own
   folder and the stdlib-only modules every worker may use (``WORKER_SHARED``); those import
   only the standard library and each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "trainperf"

# Lowest first. A room may import its own floor and those below, never one above.
FLOORS: list[tuple[str, set[str]]] = [
    ("foundation", {"__init__", "config", "protocol", "faults", "stats", "devices", "outcome",
                    "recipes", "references", "results", "env", "procs", "bench",
                    "alignments", "records", "parities", "significance", "mode_choice",
                    "result_files", "results_schema", "join", "gpucode", "gpufit",
                    "energy", "stall"}),
    ("data", {"data", "verify"}),
    ("backends", {"backends"}),
    ("launch", {"envs", "rendezvous", "runner", "progress", "breakdown", "plan_model",
                "run_kinds", "attempts", "node_agreement", "mode_probe", "emulated_nodes",
                "run_energy"}),
    ("report", {"report", "ingest", "export"}),
    ("scenarios", {"plans", "search", "align", "train", "scale", "gpucheck", "parity"}),
    ("cli", {"cli"}),
]
FRAMEWORKS = {"torch", "mxnet", "horovod", "paddle", "paddlepaddle", "jax", "jaxlib", "flax",
              "optax", "tensorflow", "keras", "oneflow"}
# Horovod is built into MXNet's environment (its collectives and rendezvous server).
FRAMEWORK_PACKAGES = {"mxnet": {"mxnet", "horovod"}, "paddle": {"paddle"},
                      "jax": {"jax", "jaxlib", "flax", "optax"}, "tf": {"tensorflow"},
                      "oneflow": {"oneflow"}}
WORKER_SHARED = {"trainperf.protocol", "trainperf.config", "trainperf.faults",
                 "trainperf.backends.workerkit", "trainperf.backends.loop",
                 "trainperf.backends.base", "trainperf.backends.catalog",
                 "trainperf.backends.scaling", "trainperf.backends.layouts",
                 "trainperf.backends.spawn", "trainperf.backends.ports",
                 "trainperf.backends.phases",
                 "trainperf.data.feed", "trainperf.data.loading",
                 "trainperf.data.shared_batches", "trainperf.data.layout",
                 "trainperf.data.recordio"}
"""What any framework's folder may import of trainperf besides itself (``spawn``: its
launchers, which start the ranks; ``data.feed`` and what it reads with: the real-data feed,
whose decoding runs in loader processes of trainperf's own interpreter)."""


def module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def imports_of(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """(trainperf modules, other top-level packages) that ``path`` imports anywhere."""
    name, is_package = module_name(path)
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (inside if alias.name.split(".")[0] == PACKAGE else outside).add(
                    alias.name if alias.name.split(".")[0] == PACKAGE
                    else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                outside.add(target.split(".")[0])
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                inside.add(sub if sub in modules else target)
    inside = {m for m in inside if m in modules}
    inside.discard(name)
    return inside, outside


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, Path]]:
    paths = {module_name(p)[0]: p for p in (SRC / PACKAGE).rglob("*.py")}
    modules = set(paths)
    inside, outside = {}, {}
    for name, path in paths.items():
        inside[name], outside[name] = imports_of(path, modules)
    return inside, outside, paths


INSIDE, OUTSIDE, PATHS = graph()


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back():
    assert cycles(INSIDE) == []


def test_no_room_imports_itself_back():
    rooms: dict[str, set[str]] = {}
    for a, targets in INSIDE.items():
        rooms.setdefault(room(a), set()).update(room(b) for b in targets if room(b) != room(a))
    assert cycles(rooms) == []


def test_every_room_has_a_floor():
    placed = set().union(*(rooms for _, rooms in FLOORS))
    assert {room(m) for m in INSIDE} == placed


def test_no_floor_imports_one_above():
    floor = {r: i for i, (_, rooms) in enumerate(FLOORS) for r in rooms}
    upward = sorted(f"{a} -> {b} ({FLOORS[floor[room(a)]][0]} imports {FLOORS[floor[room(b)]][0]})"
                    for a, targets in INSIDE.items() for b in targets
                    if floor[room(b)] > floor[room(a)])
    assert upward == []


def test_the_runner_imports_no_framework():
    code = ("import sys, trainperf.runner, trainperf.plans, trainperf.envs; "
            f"print(sorted(m for m in {sorted(FRAMEWORKS)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"


def _stdlib(name: str) -> bool:
    return name in sys.stdlib_module_names or name == "__future__"


def test_shared_worker_modules_import_only_the_standard_library():
    for name in WORKER_SHARED:
        assert INSIDE[name] <= WORKER_SHARED, name
        # workerkit reads an alignment start with numpy, which every worker has, layouts
        # converts torch's arrays with it, and the real-data feed hands over numpy batches
        allowed = ({"numpy"} if name in ("trainperf.backends.workerkit",
                                          "trainperf.backends.layouts", "trainperf.data.feed",
                                          "trainperf.data.shared_batches") else set())
        assert {m for m in OUTSIDE[name] if not _stdlib(m)} <= allowed, name


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_PACKAGES))
def test_a_worker_imports_its_framework_numpy_and_the_shared_modules(framework):
    folder = f"trainperf.backends.{framework}"
    own = [m for m in INSIDE if m == folder or m.startswith(folder + ".")]
    assert own
    for name in own:
        strays = {m for m in INSIDE[name] if m not in WORKER_SHARED
                  and not (m == folder or m.startswith(folder + "."))}
        assert not strays, f"{name} imports {sorted(strays)}"
        foreign = {m for m in OUTSIDE[name] if not _stdlib(m)
                   and m not in FRAMEWORK_PACKAGES[framework] | {"numpy"}}
        assert not foreign, f"{name} imports {sorted(foreign)}"


def test_a_backend_declaration_imports_only_the_standard_library():
    """``backend.py`` of every framework is what the runner imports of it."""
    for name in INSIDE:
        if name.startswith("trainperf.backends.") and name.endswith(".backend"):
            assert INSIDE[name] <= WORKER_SHARED, name
            assert all(_stdlib(m) for m in OUTSIDE[name]), name
