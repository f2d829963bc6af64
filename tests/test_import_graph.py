"""The project's import graph (dinfer_jax, pallas_kernels, converters): every import statement,
module level or inside a function, is an edge (except under `if TYPE_CHECKING:`). There is no
import circle among the project's modules, and none may appear."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dinfer_jax", "pallas_kernels", "converters")

def modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (the longest project-module prefix of each name)."""
    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    def runtime_nodes(tree):  # every node except those under `if TYPE_CHECKING:` (annotations only)
        todo = [tree]
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                todo.extend(node.orelse)
                continue
            yield node
            todo.extend(ast.iter_child_nodes(node))

    edges = {}
    for m, path in mods.items():
        found = set()
        for node in runtime_nodes(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found |= {r for r in map(resolve, names) if r and r != m}
        edges[m] = found
    return edges


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_circle_finder_finds_circles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(edges) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.smoke
def test_no_import_circle():
    found = circles(graph(modules()))
    assert not found, f"import circles: {[sorted(c) for c in found]}"


@pytest.mark.smoke
def test_decoding_loops_have_no_circle():
    """loop.py dispatches to block_loop.py; both read the shared row state from row_state.py."""
    edges = graph(modules())
    assert "dinfer_jax.decoding.loop" not in edges["dinfer_jax.decoding.block_loop"]
    assert "dinfer_jax.engine" not in edges["dinfer_jax.decoding.segments"]  # rows.py holds the host side
    assert not any(c & {"dinfer_jax.decoding.loop", "dinfer_jax.decoding.block_loop"} for c in circles(edges))


@pytest.mark.smoke
def test_every_module_folder_is_a_package():
    """setup.cfg's `packages = find:` ships only folders with an __init__.py: a folder of modules
    without one works from a checkout (a namespace package) but is missing from a wheel."""
    missing = sorted({os.path.relpath(os.path.dirname(p), ROOT) for p in modules().values()
                      if not os.path.exists(os.path.join(os.path.dirname(p), "__init__.py"))})
    assert not missing, f"folders of modules without __init__.py: {missing}"
