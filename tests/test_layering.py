"""The packages' layering: no import cycle inside ``stella`` or ``stella_ps`` (type-only
imports count), the client never imports the server (one documented exception), and
the container's health check loads no C extension."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"stella": os.path.join(ROOT, "client", "stella"), "stella_ps": os.path.join(ROOT, "server", "stella_ps")}
# the demo, and stella profile's measurement of the server's time, start their own stella-ps (README Layout)
CLIENT_TO_SERVER = {("stella.demo", "stella_ps.process"), ("stella.planning.measure", "stella_ps.process"),
                    ("stella.planning.measure", "stella_ps.config")}  # the dense cut's default, with no server at hand


def _imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of either package it imports (anywhere in the file), its
    sub-packages' modules included."""
    graph: dict[str, set[str]] = {}
    files = sorted((os.path.relpath(d, PACKAGES[package]), n) for d, _, names in os.walk(PACKAGES[package])
                   for n in names if n.endswith(".py"))
    for sub, name in files:
        pkg = package if sub == "." else f"{package}.{sub.replace(os.sep, '.')}"
        mod = f"{pkg}.{name[:-3]}" if name != "__init__.py" else pkg
        with open(os.path.join(PACKAGES[package], sub, name)) as f:
            tree = ast.parse(f.read())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative to the module's package, up level - 1 packages
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up) + ("." + base if base else "")
                deps.add(base)
                deps.update(f"{base}.{a.name}" for a in node.names)
        graph[mod] = {d for d in deps if d.split(".")[0] in PACKAGES}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph or d == m or d == m.rsplit(".", 1)[0]:
                continue  # a name from a module, or the package's own __init__ (`from . import __version__`)
            if state.get(d) == 1:
                return [*stack[stack.index(d):], d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in graph:
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle(package):
    graph = _imports(package)
    assert len(graph) > 10
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_client_imports_the_server_only_where_documented():
    ups = {(m, d) for m, deps in _imports("stella").items() for d in deps if d.startswith("stella_ps")}
    undocumented = {(m, d) for m, d in ups if not any(m == a and (d == b or d.startswith(b + "."))
                                                       for a, b in CLIENT_TO_SERVER)}
    assert ups and not undocumented, sorted(undocumented)


def test_the_health_check_loads_no_c_extension():
    code = ("import sys, stella_ps.health; bad = [m for m in sys.modules if m in ('cffi', 'numpy') or "
            "m.endswith(('._native', '._kernel'))]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# the client's modules the server may import: the wire (protocol, its payloads, codec, errors, the flat
# layout), the checked boundary to C and the selection over it (native_errors, native_select), and the checkpoint
# file's format
SERVER_TO_CLIENT = {"stella.protocol", "stella.payload", "stella.codec", "stella.errors", "stella.native_errors",
                    "stella.native_select", "stella.checkpoint_file", "stella.layout"}


def test_the_server_imports_only_the_clients_wire_modules():
    downs = {(m, d) for m, deps in _imports("stella_ps").items() for d in deps
             if d.startswith("stella.") and not any(d == a or d.startswith(a + ".") for a in SERVER_TO_CLIENT)}
    assert not downs, sorted(downs)


def _readme_layout_row(where: str) -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    layout = text[text.index("\n## Layout"):]
    return next(line for line in layout.splitlines() if line.startswith(f"| `{where}` |"))


def _named(stem: str, text: str) -> bool:
    """``stem`` named in ``text`` as code: `x`, `x.py`, ``x``, ``x.py``, `x/` or :mod:`pkg.x`."""
    return re.search(rf"[`.]{re.escape(stem)}(\.py|/)?`", text) is not None


def _modules(root: str) -> list[str]:
    """A package's modules and sub-packages, by name (generated modules left out)."""
    return sorted(n[:-3] if n.endswith(".py") else n for n in os.listdir(root)
                  if (n.endswith(".py") and n not in ("__init__.py", "__main__.py"))
                  or os.path.isfile(os.path.join(root, n, "__init__.py")))


@pytest.mark.parametrize("where", ["client/stella", "client/stella/planning", "server/stella_ps"])
def test_every_module_is_named_in_its_concern_map_and_the_readme_layout(where):
    root = os.path.join(ROOT, where)
    with open(os.path.join(root, "__init__.py")) as f:
        concern_map = ast.get_docstring(ast.parse(f.read())) or ""
    row = _readme_layout_row(where.split("/planning")[0] + "/")
    modules = _modules(root)
    assert len(modules) >= 6
    assert [m for m in modules if not _named(m, concern_map)] == [], f"{where}/__init__.py's concern map"
    assert [m for m in modules if not _named(m, row)] == [], "README.md's Layout"


def test_every_c_source_is_named_in_the_build_and_the_readme_layout():
    sources = sorted(n for n in os.listdir(os.path.join(ROOT, "native")) if n.endswith(".c"))
    with open(os.path.join(ROOT, "native", "build_cffi.py")) as f:
        build_doc = ast.get_docstring(ast.parse(f.read())) or ""
    row = _readme_layout_row("native/")
    assert len(sources) >= 8
    assert [s for s in sources if s not in build_doc] == [], "native/build_cffi.py's docstring"
    assert [s for s in sources if f"`{s}`" not in row] == [], "README.md's Layout"
