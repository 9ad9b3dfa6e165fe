"""The layering of docs/architecture.md, enforced by reading every import of every package file.

    rank 0  protocol  config  telemetry  kernels   (protocol, config, telemetry: neither torch nor zmq)
    rank 1  text                           (no torch)
    rank 2  model
    rank 3  engine                         (the scheduling core: names no role)
    rank 4  kvtransfer
    rank 5  worker
    rank 6  prefill_node  decode_node  router   (router: only protocol, text, config, telemetry)
    rank 7  bench
    rank 8  pdserve                        (the `pdserve` command and `pdserve up`)

A package imports only packages of lower rank, never a sibling, and always as `pdserve.<pkg>`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

ROOT = REPO

RANKS = {
    "protocol": 0, "config": 0, "telemetry": 0, "kernels": 0,
    "text": 1,
    "model": 2,
    "engine": 3,
    "kvtransfer": 4,
    "worker": 5,
    "prefill_node": 6, "decode_node": 6, "router": 6,
    "bench": 7,
    "pdserve": 8,
}
# Stricter than rank: the router runs no model, so it sees only the wire, the text and options.
ONLY = {"router": {"protocol", "text", "config", "telemetry"}}
FORBIDDEN_THIRD_PARTY = {"protocol": {"torch", "zmq"}, "config": {"torch", "zmq"}, "telemetry": {"torch", "zmq"},
                         "text": {"torch", "zmq"},
                         "router": {"torch"}}
# Every folder's __init__.py calls it first; it imports the standard library only.
GUARD = "pdserve._bare_name"
ROLE_STRINGS = {"prefill", "decode", "colocated", "prefilled"}
ROLE_NAMES = {"role", "roles", "ROLES", "prefill_only", "PREFILLED", "is_prefill_worker", "is_decode_worker"}


def package_files(pkg: str) -> list[Path]:
    files = sorted((ROOT / pkg).rglob("*.py"))
    assert files, f"no Python files in {pkg}/"
    return files


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            if node.module == "pdserve":  # `from pdserve import engine`
                out += [(node.lineno, f"pdserve.{a.name}") for a in node.names]
    return out


def pdserve_package(module: str) -> str | None:
    """'pdserve.engine.scheduler' -> 'engine'; a root module ('pdserve.cli') -> 'pdserve'."""
    parts = module.split(".")
    if parts[0] != "pdserve" or module == GUARD:
        return None
    if len(parts) > 1 and parts[1] in RANKS and parts[1] != "pdserve":
        return parts[1]
    return "pdserve"


def package_edges() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> where ('file:line')."""
    edges: dict[str, dict[str, list[str]]] = {p: {} for p in RANKS}
    for pkg in RANKS:
        for f in package_files(pkg):
            for line, mod in imports_of(f):
                dep = pdserve_package(mod)
                if dep is not None and dep != pkg:
                    edges[pkg].setdefault(dep, []).append(f"{f.relative_to(ROOT)}:{line}")
    return edges


def test_every_top_level_code_folder_has_a_rank():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    code_dirs = {Path(f).parts[0] for f in tracked.stdout.split() if len(Path(f).parts) > 1}
    assert code_dirs - {"tests"} == set(RANKS)


@pytest.mark.parametrize("pkg", sorted(RANKS))
def test_imports_point_down(pkg):
    bad = []
    for dep, where in package_edges()[pkg].items():
        allowed = ONLY.get(pkg)
        if RANKS[dep] >= RANKS[pkg] or (allowed is not None and dep not in allowed):
            bad.append(f"{pkg} -> {dep} at {', '.join(where)}")
    assert not bad, "imports against the documented direction:\n" + "\n".join(bad)


def test_no_cycle_between_packages():
    edges = {p: set(d) for p, d in package_edges().items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for p in sorted(edges):
        if p not in state:
            visit(p, [])


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN_THIRD_PARTY))
def test_light_packages_import_no_runtime(pkg):
    """The protocol and options load in any process; the router never loads torch."""
    banned = FORBIDDEN_THIRD_PARTY[pkg]
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}"
           for f in package_files(pkg) for line, mod in imports_of(f) if mod.split(".")[0] in banned]
    # What they import of pdserve must be as light: follow their pdserve imports transitively.
    seen, todo = set(), [d for d in package_edges()[pkg]]
    while todo:
        dep = todo.pop()
        if dep in seen:
            continue
        seen.add(dep)
        bad += [f"{pkg} -> {dep}: {f.relative_to(ROOT)}:{line} imports {mod}"
                for f in package_files(dep) for line, mod in imports_of(f) if mod.split(".")[0] in banned]
        todo += list(package_edges()[dep])
    assert not bad, "\n".join(bad)


def test_code_imports_pdserve_names_only():
    """`import engine` or `from kernels import ...` would find another distribution's package."""
    bare = {p for p in RANKS if p != "pdserve"}
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}"
           for pkg in [*RANKS, "tests"] for f in sorted((ROOT / pkg).rglob("*.py"))
           for line, mod in imports_of(f) if mod.split(".")[0] in bare]
    assert not bad, "\n".join(bad)


def test_scheduling_core_names_no_role():
    """No role string, role flag or role status in engine/: roles are connector configurations."""
    bad = []
    for f in package_files("engine"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ROLE_STRINGS:
                bad.append(f"{f.name}:{node.lineno} string {node.value!r}")
            names = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.arg):
                names = [node.arg]
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                names = [node.name]
            bad += [f"{f.name}:{node.lineno} name {n!r}" for n in names if n in ROLE_NAMES]
    assert not bad, "\n".join(bad)


def test_each_package_is_its_folder_through_one_link():
    """pdserve/<folder> links to <folder>/, so every tool reads `pdserve.<folder>` from the tree."""
    links = {p.name: p for p in (ROOT / "pdserve").iterdir() if p.is_symlink()}
    assert set(links) == set(RANKS) - {"pdserve"}
    assert all(link.readlink() == Path("..", name) for name, link in links.items())


@pytest.mark.parametrize("pkg", sorted(set(RANKS) - {"pdserve"}))
def test_each_folder_refuses_its_bare_name_before_anything_else(pkg):
    for init in sorted((ROOT / pkg).rglob("__init__.py")):
        if init.parent != ROOT / pkg:
            continue  # a subpackage is reached only through its folder's package
        body = [n for n in ast.parse(init.read_text()).body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert ast.unparse(body[0]) == f"from {GUARD} import refuse_bare_import", init
        assert ast.unparse(body[1]) == "refuse_bare_import(__name__)", init


def test_the_guard_imports_the_standard_library_only():
    mods = {mod.split(".")[0] for _, mod in imports_of(ROOT / "pdserve" / "_bare_name.py")}
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}
