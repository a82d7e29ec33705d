"""The import rules of docs/architecture.md "Layers", checked on the source with ``ast`` (nothing is imported).

1. No import cycle among dcp_tiered's modules. Function-level imports count; ``if TYPE_CHECKING:`` ones do not.
2. The layer table holds, function-level imports included: no module imports a higher layer, two rows of one layer
   (codecs, storage) do not import each other, and each row's "must not import" column holds (third-party names at
   module level). Modules directly under ``dcp_tiered/`` that the table does not name are layer 0;
   ``dcp_tiered/__init__.py``, the facade, is in no layer.
3. Function-level (lazy) imports of the package's own modules sit only in the modules of the "Torch-free
   boundaries" table; each of those loads no torch at import (itself and every own module that loads), and each
   of its lazy imports loads a third-party module that it does not (else that import has nothing to wait for;
   a package's ``_LAZY`` table may name light modules too: ``import pkg`` loads none of them).

``from pkg import name`` imports ``pkg.name`` where that is a module, the module ``pkg``'s ``_LAZY`` table names for
``name``, else ``pkg``. ``python tests/test_architecture.py`` prints the whole report, for whoever re-cuts a package.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from functools import cache
from itertools import takewhile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PKG = "dcp_tiered"
DOC = ROOT / "docs" / "architecture.md"
#: The words of the "must not import" column, as module prefixes.
FORBIDDEN = {"torch": "torch", "fsspec": "fsspec", "DCP": "torch.distributed.checkpoint", "tiers": "dcp_tiered.tiers",
             "schedules": "dcp_tiered.tiers.schedule", "CLI": "dcp_tiered.cli", "Prometheus": "prometheus_client"}
MODULES = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
           for p in sorted((ROOT / PKG).rglob("*.py"))}


class Import(NamedTuple):
    source: str
    target: str
    line: int
    lazy: bool

    def __str__(self) -> str:
        return f"{MODULES[self.source].relative_to(ROOT)}:{self.line} {self.source} -> {self.target}" + " (lazy)" * self.lazy


def _is_lazy_table(node: ast.AST) -> bool:
    return isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_LAZY" and isinstance(node.value, ast.Dict)


LAZY = {m: ast.literal_eval(n.value) for m, p in MODULES.items() for n in ast.parse(p.read_text()).body if _is_lazy_table(n)}


def _resolve(pkg: str, name: str) -> str:
    if f"{pkg}.{name}" in MODULES or (pkg in MODULES and any(MODULES[pkg].parent.glob(f"{name}.*"))):  # .py, .c, .so
        return f"{pkg}.{name}"
    return LAZY.get(pkg, {}).get(name, pkg)


def imports_of(mod: str) -> list[Import]:
    path, found = MODULES[mod], []
    here = (mod if path.name == "__init__.py" else mod.rpartition(".")[0]).split(".")

    def walk(node: ast.AST, lazy: bool) -> None:
        lazy = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.Import):
            found.extend(Import(mod, a.name, node.lineno, lazy) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            pkg = ".".join(here[: len(here) + 1 - node.level] * bool(node.level) + [node.module or ""]).strip(".")
            found.extend(Import(mod, _resolve(pkg, a.name), node.lineno, lazy) for a in node.names)
        elif _is_lazy_table(node):  # a package's lazy __getattr__ (dcp_tiered.lazy.lazy_attributes)
            found.extend(Import(mod, v.value, v.lineno, True) for v in node.value.values)
        typing_only = isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for child in node.orelse if typing_only else ast.iter_child_nodes(node):
            walk(child, lazy)

    walk(ast.parse(path.read_text(), str(path)), False)
    return found


IMPORTS = sorted({i for m in MODULES for i in imports_of(m)}, key=lambda i: (i.source, i.line, i.target))
OWN = [i for i in IMPORTS if i.target in MODULES and i.target != i.source]
GRAPH = defaultdict(list)
for _imp in OWN:
    GRAPH[_imp.source].append(_imp)


@cache
def reach(mod: str, lazy: bool = True, parents: bool = False) -> frozenset[str]:
    """The own modules ``mod`` reaches by imports (``lazy=False``: module-level ones). ``reach(m, False, True)`` is
    what importing ``m`` runs: its module-level imports and the parent packages, whose ``__init__`` runs first."""
    seen, todo = set(), [mod]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += [i.target for i in GRAPH[m] if lazy or not i.lazy]
            todo += [m.rsplit(".", k)[0] for k in range(1, m.count(".") + 1)] if parents else []
    return frozenset(seen)


def cycles(lazy: bool = True) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module."""
    return sorted(sorted(c) for c in {frozenset(n for n in reach(m, lazy) if m in reach(n, lazy)) for m in MODULES}
                  if len(c) > 1)


def stats(modules: list[str], lazy: bool = True) -> tuple[int, int, int]:
    """(modules, import edges among them, layers: modules on the longest import chain among them, a cycle as one)."""
    edges = {(i.source, i.target) for i in OWN if i.source in modules and i.target in modules and (lazy or not i.lazy)}
    group = {m: frozenset(c) for c in cycles(lazy) for m in c}

    @cache
    def chain(g: frozenset[str]) -> int:
        return 1 + max((chain(group.get(t, frozenset([t]))) for s, t in edges if s in g and t not in g), default=0)
    return len(modules), len(edges), max((chain(group.get(m, frozenset([m]))) for m in modules), default=0)


def _table(heading: str) -> list[list[str]]:
    """The cells of the first markdown table after ``heading`` in the doc, header and separator dropped."""
    parts = DOC.read_text().split(f"\n{heading}\n", 1)
    assert len(parts) == 2, f"{DOC.name} has no {heading!r} section: tests/test_architecture.py reads it"
    after = parts[1].splitlines()
    rows = list(takewhile(lambda ln: ln.startswith("|"), after[next((n for n, ln in enumerate(after) if ln.startswith("|")), 0):]))
    assert len(rows) > 2 and set(rows[1]) <= set("|-: "), f"{DOC.name}: no markdown table under {heading!r}"
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows[2:]]


def _named_modules(cell: str) -> list[str]:
    """The modules a cell names: `dcp_tiered/codecs/` (a package and all below it), `cost.py`, `dcp_tiered/x/y.py`."""
    names = [".".join(Path(n if n.startswith(PKG) else f"{PKG}/{n}").with_suffix("").parts).removesuffix(".__init__")
             for n in re.findall(r"`([^`]+\.py|[^`]+/)`", cell)]
    assert names and all(n in MODULES for n in names), f"{DOC.name}: {cell!r} names no module, or one that is not there"
    return names


@cache
def layers() -> dict[str, tuple[int, int, tuple[str, ...]]]:
    """Package or module -> (layer, row, forbidden prefixes), from the "## Layers" table."""
    out = {}
    for row, cells in enumerate(_table("## Layers")):
        assert len(cells) == 4 and re.match(r"\d+ ", cells[0]), f"{DOC.name}: unreadable layer row {cells}"
        words = [] if cells[3].startswith("—") else [w.strip() for w in cells[3].split(",")]
        assert set(words) <= set(FORBIDDEN), f"{DOC.name}: 'must not import' words missing from FORBIDDEN: {words}"
        out.update((m, (int(cells[0].split()[0]), row, tuple(FORBIDDEN[w] for w in words))) for m in _named_modules(cells[1]))
    return out


def layer_of(mod: str) -> tuple[int, int, tuple[str, ...]] | None:
    match = max((p for p in layers() if mod == p or mod.startswith(p + ".")), key=len, default=None)
    ground = mod.count(".") == 1 and MODULES[mod].name != "__init__.py"
    return layers()[match] if match else (0, -1, ()) if ground else None


@cache
def boundaries() -> dict[str, str]:
    """Module -> why its imports wait, from the "### Torch-free boundaries" table (a package row: all below it)."""
    out = {}
    for cells in _table("### Torch-free boundaries"):
        for name in _named_modules(cells[0]):
            dir_row = cells[0].rstrip("`").endswith("/")
            out.update((m, cells[1]) for m in MODULES if m == name or dir_row and m.startswith(name + "."))
    return out


@cache
def third_party(mod: str) -> frozenset[str]:
    """The top-level third-party modules that importing ``mod`` imports at module level."""
    tops = {i.target.split(".")[0] for i in IMPORTS if i.source in reach(mod, False, True) and not i.lazy}
    return frozenset(t for t in tops if t not in sys.stdlib_module_names and t != PKG)


def layer_violations() -> list[str]:
    out = [f"{m}: in no row of the layer table" for m in MODULES if m != PKG and layer_of(m) is None]
    for imp in IMPORTS:
        src, dst = layer_of(imp.source), layer_of(imp.target) if imp.target in MODULES else None
        if src and dst and (dst[0] > src[0] or dst[0] == src[0] and dst[1] != src[1]):
            out.append(f"{imp}: layer {src[0]} imports layer {dst[0]}" + " of another row" * (dst[0] == src[0]))
        bad = [p for p in (src[2] if src else ()) if imp.target == p or imp.target.startswith(p + ".")]
        if bad and (not imp.lazy or imp.target.startswith(PKG)):
            out.append(f"{imp}: its layer's row says it must not import {bad[0]}")
    return out


def lazy_violations() -> list[str]:
    out = [f"{imp}: not in a torch-free boundary" for imp in OWN if imp.lazy and imp.source not in boundaries()]
    for b in boundaries():
        out += [f"{imp}: torch-free boundary {b} loads it at import" for imp in IMPORTS
                if imp.source in reach(b, False, True) and not imp.lazy and imp.target.split(".")[0] == "torch"]
        out += [f"{imp}: waits for nothing (loads no third-party module that {b} does not); import it at the top"
                for imp in OWN if imp.source == b and imp.lazy and MODULES[b].name != "__init__.py"
                and not third_party(imp.target) - third_party(b)]
    return out


def _cycle_report() -> list[str]:
    return [f"cycle of {len(c)}: {c}\n  " + "\n  ".join(str(i) for i in OWN if i.source in c and i.target in c) for c in cycles()]


def test_no_import_cycles():
    assert not cycles(), "\n".join(_cycle_report())


def test_layer_table_holds():
    violations = layer_violations()
    assert not violations, f"{len(violations)} violations of the layer table:\n" + "\n".join(violations)


def test_lazy_imports_only_at_torch_free_boundaries():
    assert PKG in boundaries(), "dcp_tiered/__init__.py must be a torch-free boundary: `import dcp_tiered` stays light"
    violations = lazy_violations()
    assert not violations, f"{len(violations)} lazy imports out of place:\n" + "\n".join(violations)


if __name__ == "__main__":
    print(f"== {len(cycles())} import cycles ({len(cycles(False))} through module-level imports alone)")
    print("\n".join(_cycle_report()))
    print("\n== layer violations\n" + "\n".join(layer_violations()))
    print("\n== lazy-import violations\n" + "\n".join(lazy_violations()))
    in_cycle, lazy = {m: n for n, c in enumerate(cycles()) for m in c}, defaultdict(list)
    for imp in (i for i in OWN if i.lazy):
        lazy[imp.source].append(f"{imp.line}{'*' * (in_cycle.get(imp.source, -1) == in_cycle.get(imp.target, -2))}")
    print(f"\n== {sum(map(len, lazy.values()))} lazy own imports by module (line, * = both ends on one cycle)")
    for mod, lines in sorted(lazy.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(lines):4} {mod}{' [boundary]' * (mod in boundaries())}: {' '.join(lines)}")
    print("\n== per package: (modules, import edges, layers = modules on the longest import chain, a cycle as one)")
    for pkg in [PKG] + sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and m != PKG):
        alone, whole = ([m for m in MODULES if m == pkg or f(m)] for f in (lambda m: m.rpartition(".")[0] == pkg,
                                                                           lambda m: m.startswith(pkg + ".")))
        print(f"{pkg:24} alone {stats(alone)}, module-level only {stats(alone, False)}; with sub-packages {stats(whole)}")
