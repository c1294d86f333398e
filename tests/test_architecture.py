"""The import-layer check (scripts/check_layers.py, issue 25): the tree keeps its
floors, and the check fails on a fake tree that breaks each rule."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_layers.py"


def run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True, timeout=60
    )


def make_tree(root: Path, files: dict[str, str]) -> Path:
    """A tree laid out as this repository: every folder of a module gets an __init__.py."""
    for name, source in files.items():
        path = root / name
        for folder in path.relative_to(root).parents:
            if folder.parts and folder.parts[-1] != "client":
                (root / folder).mkdir(parents=True, exist_ok=True)
                (root / folder / "__init__.py").touch()
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return root


def test_the_tree_keeps_its_layers() -> None:
    """No import cycle, no upward or sibling import, no inner module of a storage
    subpackage imported from outside it: the floors of issue 25, as the table at the
    top of scripts/check_layers.py writes them."""
    result = run_check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and "no cycle, no upward import" in lines[0], lines


# A small tree that keeps every rule: the cli on top, storage below the server, the
# client at the bottom.
CLEAN = {
    "lmcache_server/cli.py": "from . import __version__\ndef main():\n    from .app import App\n",
    "lmcache_server/app.py": "from .server.handlers import Handlers\nfrom .storage.disk import DiskTier\n",
    "lmcache_server/server/handlers.py": "from ..storage import TieredStore\nclass Handlers: ...\n",
    "lmcache_server/storage/__init__.py": "from .tiered import TieredStore\n",
    "lmcache_server/storage/tiered/__init__.py": "from .store import TieredStore\n",
    "lmcache_server/storage/tiered/store.py": "from ..disk import DiskTier\nfrom ..base import Chunk\n"
    "class TieredStore: ...\n",
    "lmcache_server/storage/disk/__init__.py": "from .tier import DiskTier\n",
    "lmcache_server/storage/disk/tier.py": "from ..base import Chunk\nfrom ...config import Config\nDiskTier = 1\n",
    "lmcache_server/storage/base.py": "from lmcache_client.protocol import PutStatus\nclass Chunk: ...\n",
    "lmcache_server/config.py": "class Config: ...\n",
    "client/lmcache_client/__init__.py": "from .protocol import PutStatus\n",
    "client/lmcache_client/protocol/__init__.py": "PutStatus = 1\n",
    "client/lmcache_client/integrations/vllm/connector.py": "from ..transfer import ChunkTransfer\n",
    "client/lmcache_client/integrations/transfer.py": "from ..client import CacheClient\nChunkTransfer = 1\n",
    "client/lmcache_client/client.py": "from .protocol import PutStatus\nCacheClient = 1\n",
}


def violations(tmp_path: Path, **changed: str) -> list[str]:
    """The violation lines for CLEAN with the files in ``changed`` replaced or added."""
    files = {**CLEAN, **changed}
    result = run_check(make_tree(tmp_path, files))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "violations" in result.stderr
    return result.stdout.splitlines()


def test_a_tree_that_keeps_the_rules_passes(tmp_path: Path) -> None:
    result = run_check(make_tree(tmp_path, CLEAN))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("check_layers: "), lines
    assert "no cycle, no upward import" in lines[0]
    assert "1 inside functions" in lines[0]  # cli's lazy import of app


def test_two_modules_importing_each_other_are_a_cycle(tmp_path: Path) -> None:
    lines = violations(
        tmp_path,
        **{
            "lmcache_server/storage/remote/__init__.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from .. import memory\nRedisTier = 1\n",
            "lmcache_server/storage/memory/__init__.py": "def fill():\n    from .. import remote\n",
        },
    )
    assert lines == [
        "lmcache_server/storage/memory/__init__.py:2 imports lmcache_server.storage.remote [in a function]: "
        "storage.memory may not import storage.remote (siblings in storage layer 3)",
        "lmcache_server/storage/remote/__init__.py:3 imports lmcache_server.storage.memory [TYPE_CHECKING]: "
        "storage.remote may not import storage.memory (siblings in storage layer 3)",
        "import cycle: lmcache_server.storage.memory -> lmcache_server.storage.remote -> "
        "lmcache_server.storage.memory (lmcache_server/storage/memory/__init__.py:2 [in a function]; "
        "lmcache_server/storage/remote/__init__.py:3 [TYPE_CHECKING])",
    ]


def test_a_cycle_inside_one_room_is_reported_as_a_path(tmp_path: Path) -> None:
    lines = violations(
        tmp_path,
        **{
            "lmcache_server/storage/memory/tier.py": "from . import warm\n",
            "lmcache_server/storage/memory/warm.py": "from .pool import Pool\n",
            "lmcache_server/storage/memory/pool.py": "import lmcache_server.storage.memory.tier\nPool = 1\n",
        },
    )
    assert lines == [
        "import cycle: lmcache_server.storage.memory.pool -> lmcache_server.storage.memory.tier -> "
        "lmcache_server.storage.memory.warm -> lmcache_server.storage.memory.pool "
        "(lmcache_server/storage/memory/pool.py:1; lmcache_server/storage/memory/tier.py:1; "
        "lmcache_server/storage/memory/warm.py:1)"
    ]


def test_a_lower_layer_importing_a_higher_one_is_reported(tmp_path: Path) -> None:
    lines = violations(
        tmp_path,
        **{
            "lmcache_server/storage/base.py": "class Chunk: ...\ndef f():\n    from ..server import http\n",
            "lmcache_server/server/http.py": "",
            "lmcache_server/supervisor.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from .summary import Summary\n",
            "lmcache_server/summary.py": "",
        },
    )
    assert lines == [
        "lmcache_server/storage/base.py:3 imports lmcache_server.server.http [in a function]: "
        "storage may not import server (layer 4 -> layer 7)",
        "lmcache_server/supervisor.py:3 imports lmcache_server.summary [TYPE_CHECKING]: "
        "supervisor may not import summary (layer 3 -> layer 6)",
    ]


def test_the_client_never_imports_the_daemon(tmp_path: Path) -> None:
    lines = violations(
        tmp_path,
        **{"client/lmcache_client/client.py": "from lmcache_server import __version__\nCacheClient = 1\n"},
    )
    assert lines == [
        "client/lmcache_client/client.py:1 imports lmcache_server: lmcache_client may not import version "
        "(layer 1 -> layer 2)"
    ]


def test_the_daemon_never_imports_an_engine_adapter(tmp_path: Path) -> None:
    """The layers would let the cli import any of lmcache_client; FORBIDDEN keeps the
    engine adapters out of the daemon, lazy imports included."""
    lines = violations(
        tmp_path,
        **{
            "lmcache_server/admin.py": "from lmcache_client.integrations.vllm.connector import key_root\n",
            "lmcache_server/storage/base.py": "def f():\n    from lmcache_client import integrations\n",
        },
    )
    assert lines == [
        "lmcache_server/admin.py:1 imports lmcache_client.integrations.vllm.connector: the daemon never imports "
        "an engine adapter (lmcache_server* may not import lmcache_client.integrations*)",
        "lmcache_server/storage/base.py:2 imports lmcache_client.integrations [in a function]: the daemon never "
        "imports an engine adapter (lmcache_server* may not import lmcache_client.integrations*)",
    ]


def test_every_pattern_of_the_tables_holds_a_module_of_the_tree() -> None:
    """No stale pattern (a module of an old layout) stays in LAYERS, SEALED or FORBIDDEN."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    assert spec is not None and spec.loader is not None
    check_layers = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = check_layers  # dataclasses look their module up
    try:
        spec.loader.exec_module(check_layers)
    finally:
        del sys.modules["check_layers"]
    modules = check_layers.find_modules(ROOT)
    patterns = [p for scope in check_layers.LAYERS.values() for layer in scope for room in layer.values() for p in room]
    patterns += [f"{parent}*" for parent in check_layers.SEALED]
    patterns += [p for rule in check_layers.FORBIDDEN for p in rule[:2]]
    stale = [p for p in patterns if not any(check_layers._matches(p, m) for m in modules)]
    assert not stale


def test_sibling_rooms_stay_apart(tmp_path: Path) -> None:
    lines = violations(
        tmp_path,
        **{
            "lmcache_server/storage/disk/tier.py": "from ..memory import MemoryTier\n",
            "lmcache_server/storage/memory/__init__.py": "MemoryTier = 1\n",
            "client/lmcache_client/integrations/sglang.py": "from .vllm.connector import x\n",
            "client/lmcache_client/client.py": "def f():\n    from .integrations import chunklayout\n",
            "client/lmcache_client/integrations/chunklayout.py": "",
        },
    )
    assert lines == [
        "client/lmcache_client/client.py:2 imports lmcache_client.integrations.chunklayout [in a function]: "
        "client core may not import integrations shared (lmcache_client layer 2 -> lmcache_client layer 3)",
        "client/lmcache_client/integrations/sglang.py:1 imports lmcache_client.integrations.vllm.connector: "
        "integrations.sglang may not import integrations.vllm (siblings in lmcache_client layer 4)",
        "lmcache_server/storage/disk/tier.py:1 imports lmcache_server.storage.memory: "
        "storage.disk may not import storage.memory (siblings in storage layer 3)",
    ]


def test_only_a_storage_subpackages_init_is_open_to_the_rest(tmp_path: Path) -> None:
    lines = violations(
        tmp_path,
        **{"lmcache_server/app.py": "from .storage.disk import DiskTier\nfrom .storage.disk.tier import DiskTier\n"},
    )
    assert lines == [
        "lmcache_server/app.py:2 imports lmcache_server.storage.disk.tier: "
        "only lmcache_server.storage.disk (its __init__) is open to code outside it"
    ]


def test_a_module_in_no_room_and_an_import_of_no_module_are_reported(tmp_path: Path) -> None:
    lines = violations(
        tmp_path,
        **{
            "lmcache_server/attic.py": "",
            "lmcache_server/storage/tiered/store.py": "from ..diskfiles import aligned_copy\n",
        },
    )
    assert lines == [
        "lmcache_server/attic.py: lmcache_server.attic is in no room of the top layers "
        "(add it to LAYERS in scripts/check_layers.py)",
        "lmcache_server/storage/tiered/store.py:1 imports lmcache_server.storage.diskfiles: no such module in the tree",
    ]


# Compose, don't slice (STYLE.md rule 11, issue 40): a class of ours that is never built
# and has exactly one subclass exists only to move lines into another file.  Engine API
# classes we subclass (vLLM's KVConnectorBase_V1 & co., SGLang's HiCacheStorage) and real
# specialisations (built on their own too: LFUDAPolicy, ChunkLayout, PagedCopier) are
# not slices.
ENGINE_API = {"KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorStats", "SupportsHMA", "HiCacheStorage"}
"""The engines' own classes (their stand-ins in compat modules when the engine is absent)."""
PACKAGES = (ROOT / "lmcache_server", ROOT / "client" / "lmcache_client")


def _sliced_classes() -> set[str]:
    """Our classes never called by name anywhere in the packages, with exactly one
    subclass among our classes."""
    import ast
    from collections import defaultdict

    defined: set[str] = set()
    subclasses: dict[str, list[str]] = defaultdict(list)
    called: set[str] = set()
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    defined.add(node.name)
                    for base in node.bases:
                        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                        if name:
                            subclasses[name].append(node.name)
                elif isinstance(node, ast.Call):
                    func = node.func
                    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                    if name:
                        called.add(name)
    return {c for c in defined - ENGINE_API if len(subclasses.get(c, [])) == 1 and c not in called}


def test_no_class_is_sliced_across_files_by_inheritance() -> None:
    sliced = sorted(_sliced_classes())
    assert not sliced, f"classes that only move lines into another file (compose them, STYLE.md rule 11): {sliced}"
