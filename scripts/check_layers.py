#!/usr/bin/env python3
"""The import-layer check (issue 25): the floors of the house run one way, and no
two modules import each other.

It reads every module of ``lmcache_server`` and ``client/lmcache_client`` with
``ast`` (stdlib only), resolves each import to a module of these two packages
(absolute and relative, ``from . import x``, imports inside functions and under
``if TYPE_CHECKING:``) and fails, one line per violation, on:

1. an import cycle (strongly connected components of the import graph, each
   reported as a path ``a -> b -> a``).  Every import is an edge, including the
   ones inside functions and under TYPE_CHECKING: a lazy or type-only import back
   hides a circle from the interpreter but not from the design (policy.py's
   in-function import of adaptive.py was one of the three circles issue 25 cut).
   CYCLE_KINDS below says which kinds count.
2. a lower layer importing a higher one, or a room importing a sibling room of
   its layer (LAYERS below).
3. code outside a storage subpackage importing one of its inner modules: only the
   subpackage's ``__init__`` is its face (SEALED below).
4. an import FORBIDDEN below names, whatever the layers allow: the daemon never
   imports an engine adapter (``lmcache_client.integrations``).
5. a module that no room of LAYERS holds, an import of a module that does not
   exist, and a file that does not parse.

Tests and benchmarks are not checked.  Run: ``python scripts/check_layers.py``
(``--root DIR`` checks another tree laid out like this repository).  Exit 0 with
a one-line summary when clean, 1 with the violations otherwise.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# --- the rules: edit these tables to move a module -------------------------------------
#
# LAYERS[scope] lists that scope's layers, the TOP one first.  A layer is a dict of
# rooms, room name -> module patterns.  A pattern is a dotted module name, or a prefix
# ending in "*": "lmcache_server.storage.memory*" holds the storage/memory/ subpackage
# and everything in it.  The longest matching pattern wins.
# A module may import its own room, and any room of a LOWER layer; never a higher
# layer, and never another room of its own layer (siblings stay apart).  When both
# modules sit in the same room and LAYERS has a scope named after that room, the
# rule is applied again with that scope's layers.
LAYERS: dict[str, list[dict[str, list[str]]]] = {
    "": [  # the whole tree
        # admin.py (and admincache.py) is a command-line tool the cli dispatches to (a client of a running
        # daemon, over lmcache_client): nothing below the cli may import it.
        {"cli": ["lmcache_server.cli", "lmcache_server.__main__", "lmcache_server.admin*", "lmcache_server.cleanup"]},
        {"app": ["lmcache_server.app", "lmcache_server.daemon"]},  # the lifecycle and the parts it builds
        {"server": ["lmcache_server.server*"]},
        {"security": ["lmcache_server.security*"], "summary": ["lmcache_server.summary"]},  # guard reads metrics
        {"metrics": ["lmcache_server.metrics*"], "events": ["lmcache_server.events*"]},  # both read storage
        {"storage": ["lmcache_server.storage*"]},
        # storage reads config (redact, ConfigError) and runs its tasks under the
        # supervisor; config parses the codec settings with kv_codec.
        {
            "config": [
                "lmcache_server.config",
                "lmcache_server.serverconfig",
                "lmcache_server.configvalues",
                "lmcache_server.configprint",  # --print-config's YAML (the cli prints it)
                "lmcache_server.lmcacheconfig",  # what an LMCache engine config's keys and URLs mean here
                "lmcache_server.kv_codec",
            ],
            "supervisor": ["lmcache_server.supervisor"],
            # one daemon per spill directory and per ipc:// socket: storage and server take it
            "filelock": ["lmcache_server.filelock"],
            # systemd's readiness datagram: the app says ready and stopping
            "sdnotify": ["lmcache_server.sdnotify"],
        },
        {"version": ["lmcache_server"]},  # lmcache_server/__init__.py: __version__ only
        {"lmcache_client": ["lmcache_client*"]},  # the client never imports the daemon
    ],
    "storage": [
        {"storage face": ["lmcache_server.storage"]},  # storage/__init__.py
        {"storage.tiered": ["lmcache_server.storage.tiered*"]},  # the store, its parts and the tier gate
        {
            "storage.memory": ["lmcache_server.storage.memory*"],
            "storage.disk": ["lmcache_server.storage.disk*"],
            "storage.remote": ["lmcache_server.storage.remote*"],
        },
        {"storage.policy": ["lmcache_server.storage.policy*"]},
        {
            "storage leaves": [
                "lmcache_server.storage.base*",
                "lmcache_server.storage.chunkfile*",
                "lmcache_server.storage.offload*",
                "lmcache_server.storage.tenants*",
                "lmcache_server.storage.sizing",  # the sizing telemetry's sketches (hit-rate ceiling)
                "lmcache_server.storage.statefiles",  # the private state directory and its files
            ],
        },
    ],
    "lmcache_client": [
        {
            "integrations.vllm": ["lmcache_client.integrations.vllm*"],
            "integrations.sglang": ["lmcache_client.integrations.sglang*"],
            "integrations.hf": ["lmcache_client.integrations.hf*"],
        },
        # what the engines share: transfer, paged, layout, coded, the package's __init__
        {"integrations shared": ["lmcache_client.integrations*"]},
        {"client core": ["lmcache_client*"]},
        {"client protocol": ["lmcache_client.protocol*"]},
    ],
}

# A subpackage directly under one of these packages shows only its __init__ to code
# outside it: lmcache_server.app may import lmcache_server.storage.disk, not
# lmcache_server.storage.disk.tier (nor lmcache_server.server.shm.leases).  The sealed rooms of
# storage: memory, disk, remote, policy and tiered (the store: code outside imports
# lmcache_server.storage.tiered, not its modules); of the server: shm.
SEALED: list[str] = ["lmcache_server.storage", "lmcache_server.server"]

# Imports no module matching the first pattern may make of a module matching the second
# (patterns as in LAYERS), whatever the layers allow, and why.
FORBIDDEN: list[tuple[str, str, str]] = [
    # The admin CLI computes the connector's keys with lmcache_client.keys, as the connector does.
    ("lmcache_server*", "lmcache_client.integrations*", "the daemon never imports an engine adapter"),
]

# Which imports form the graph the cycle check walks: "module" (run at import time),
# "type" (under if TYPE_CHECKING:), "function" (inside a def, run lazily).
# The layer and subpackage rules apply to every import whatever its kind.
CYCLE_KINDS: frozenset[str] = frozenset({"module", "type", "function"})

# Where the packages live, relative to the root of the tree.
PACKAGES: dict[str, str] = {"lmcache_server": "lmcache_server", "lmcache_client": "client/lmcache_client"}

# ----------------------------------------------------------------------------------------

KIND_NOTE = {"module": "", "type": " [TYPE_CHECKING]", "function": " [in a function]"}


@dataclass(frozen=True)
class Module:
    name: str  # dotted
    path: Path
    shown: str  # the path as reported, relative to the root
    is_package: bool


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (or the name that is no module, when missing)
    line: int
    kind: str  # module | type | function
    missing: bool = False


def find_modules(root: Path) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package, folder in PACKAGES.items():
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            is_package = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_package else parts)))
            modules[name] = Module(name, path, path.relative_to(root).as_posix(), is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under ``node`` with its kind."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _imports(child, "function")
        elif isinstance(child, ast.If) and _is_type_checking(child.test) and kind == "module":
            for stmt in child.body:
                if isinstance(stmt, ast.Import | ast.ImportFrom):
                    yield stmt, "type"
                else:
                    yield from _imports(stmt, "type")
            for stmt in child.orelse:
                if isinstance(stmt, ast.Import | ast.ImportFrom):
                    yield stmt, kind
                else:
                    yield from _imports(stmt, kind)
        else:
            yield from _imports(child, kind)


def resolve(module: Module, tree: ast.Module, modules: dict[str, Module]) -> list[Import]:
    """The imports of ``module`` that land in our packages, each resolved to the most
    specific module it names."""
    found: list[Import] = []

    def add(target: str, line: int, kind: str) -> None:
        if target.split(".")[0] not in PACKAGES:
            return
        if target in modules:
            found.append(Import(module.name, target, line, kind))
        else:
            found.append(Import(module.name, target, line, kind, missing=True))

    for stmt, kind in _imports(tree, "module"):
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                add(alias.name, stmt.lineno, kind)
            continue
        if stmt.level:
            package = module.name if module.is_package else module.name.rpartition(".")[0]
            parts = package.split(".")
            if stmt.level - 1 >= len(parts):
                add(f"{'.' * stmt.level}{stmt.module or ''} (beyond the top package)", stmt.lineno, kind)
                continue
            base = ".".join(parts[: len(parts) - (stmt.level - 1)])
            base = f"{base}.{stmt.module}" if stmt.module else base
        else:
            base = stmt.module or ""
        for alias in stmt.names:
            sub = f"{base}.{alias.name}"
            add(sub if sub in modules else base, stmt.lineno, kind)
    return found


def room_of(scope: str, module: str) -> tuple[int, str] | None:
    """(layer index from the top, room name) of ``module`` in ``scope``, by its longest
    matching pattern."""
    best: tuple[int, int, str] | None = None  # (pattern length, layer index, room)
    for index, layer in enumerate(LAYERS[scope]):
        for room, patterns in layer.items():
            for pattern in patterns:
                prefix = pattern.removesuffix("*")
                hit = module.startswith(prefix) if pattern.endswith("*") else module == pattern
                if hit and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), index, room)
    return None if best is None else (best[1], best[2])


def unplaced(module: str) -> str | None:
    """The scope in which no room holds ``module``, or None when every scope places it."""
    scope = ""
    while True:
        place = room_of(scope, module)
        if place is None:
            return scope or "top"
        if place[1] not in LAYERS:
            return None
        scope = place[1]


def layer_rule(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target``, or None when it may."""
    scope = ""
    while True:
        mine, theirs = room_of(scope, source), room_of(scope, target)
        if mine is None or theirs is None:
            return None  # reported once per module by unplaced()
        if mine[1] == theirs[1]:
            if mine[1] not in LAYERS:
                return None
            scope = mine[1]
            continue
        count = len(LAYERS[scope])
        where = f"{scope} " if scope else ""
        if mine[0] > theirs[0]:
            return (
                f"{mine[1]} may not import {theirs[1]} "
                f"({where}layer {count - mine[0]} -> {where}layer {count - theirs[0]})"
            )
        if mine[0] == theirs[0]:
            return f"{mine[1]} may not import {theirs[1]} (siblings in {where}layer {count - mine[0]})"
        return None


def sealed_rule(source: str, target: str) -> str | None:
    for parent in SEALED:
        if not target.startswith(parent + "."):
            continue
        rest = target[len(parent) + 1 :].split(".")
        if len(rest) < 2:
            continue
        face = f"{parent}.{rest[0]}"
        if source != face and not source.startswith(face + "."):
            return f"only {face} (its __init__) is open to code outside it"
    return None


def _matches(pattern: str, module: str) -> bool:
    return module.startswith(pattern.removesuffix("*")) if pattern.endswith("*") else module == pattern


def forbidden_rule(source: str, target: str) -> str | None:
    for importer, imported, why in FORBIDDEN:
        if _matches(importer, source) and _matches(imported, target):
            return f"{why} ({importer} may not import {imported})"
    return None


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph`` with more than one module, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, ())):
            if child not in within:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    return [start, start]  # unreachable inside a component


def check(root: Path) -> tuple[list[str], str]:
    """(violation lines, summary) for the tree at ``root``."""
    modules = find_modules(root)
    problems: list[tuple[str, int, str]] = []  # (path, line, text) sorted later
    imports: list[Import] = []
    for module in modules.values():
        try:
            tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=module.shown)
        except (SyntaxError, UnicodeDecodeError) as err:
            problems.append((module.shown, getattr(err, "lineno", 0) or 0, f"{module.shown}: does not parse: {err}"))
            continue
        imports.extend(resolve(module, tree, modules))
        scope = unplaced(module.name)
        if scope is not None:
            problems.append(
                (
                    module.shown,
                    0,
                    f"{module.shown}: {module.name} is in no room of the {scope} layers "
                    "(add it to LAYERS in scripts/check_layers.py)",
                )
            )
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], Import] = {}
    for imp in imports:
        shown = modules[imp.source].shown
        head = f"{shown}:{imp.line} imports {imp.target}{KIND_NOTE[imp.kind]}"
        if imp.missing:
            problems.append((shown, imp.line, f"{head}: no such module in the tree"))
            continue
        rules = (layer_rule, sealed_rule, forbidden_rule)
        for reason in (rule(imp.source, imp.target) for rule in rules):
            if reason is not None:
                problems.append((shown, imp.line, f"{head}: {reason}"))
        if imp.kind in CYCLE_KINDS and imp.source != imp.target:
            graph.setdefault(imp.source, set()).add(imp.target)
            edge = (imp.source, imp.target)
            if edge not in where or (where[edge].kind != "module" and imp.kind == "module"):
                where[edge] = imp
    lines = [text for _, _, text in sorted(problems)]
    cycles = 0
    for component in strongly_connected(graph):
        members, covered = set(component), set()
        for start in component:
            if start in covered:
                continue
            path = shortest_cycle(graph, start, members)
            covered.update(path)
            steps = [where[(a, b)] for a, b in zip(path, path[1:])]
            notes = "; ".join(f"{modules[s.source].shown}:{s.line}{KIND_NOTE[s.kind]}" for s in steps)
            lines.append(f"import cycle: {' -> '.join(path)} ({notes})")
            cycles += 1
    kinds = {kind: sum(1 for imp in imports if imp.kind == kind) for kind in KIND_NOTE}
    summary = (
        f"{len(modules)} modules, {len(imports)} imports ({kinds['type']} under TYPE_CHECKING, "
        f"{kinds['function']} inside functions), no cycle, no upward import"
    )
    if lines:
        summary = f"{len(lines)} violations ({cycles} import cycles)"
    return lines, summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="the tree to check")
    args = parser.parse_args(argv)
    lines, summary = check(args.root)
    for line in lines:
        print(line)
    print(f"check_layers: {summary}", file=sys.stderr if lines else sys.stdout)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
