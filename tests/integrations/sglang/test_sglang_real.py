"""The SGLang HiCache backend against SGLang's real classes (sglang 0.5.23, on CPU).

SGLang lives in its own venv (``make setup-sglang``: ``.venv-sglang``, or the
python named by ``LMCACHE_SGLANG_PYTHON``); these tests run in the main venv
and start tests/integrations/sglang/sglang_harness/replica.py with that python, against real
daemons.  Replica A builds SGLang's own host pools, its ``HybridCacheController``
(what a plain model's HiCache uses in 0.5.23) and our backend through
SGLang's ``StorageBackendFactory`` from the documented extra config, and
moves pages through the controller's own storage threads, in the generic
and the zero-copy (``interface_v1``) path, for every host layout that
constructs on CPU; replica B, a fresh process, loads what A stored.  A
missing SGLang venv fails these tests with the command to build it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ...conftest import Daemon

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[3]
SGLANG_PYTHON = Path(os.environ.get("LMCACHE_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
DOCS = ROOT / "docs" / "integrations.md"
DOCS_ADDRESS = "tcp://127.0.0.1:65432"
PAGE = 16  # tests/integrations/sglang/sglang_harness/engine.py
# (daemon, model kind, host layout) of replica A's matrix, in its order
MATRIX = [("shm", "mha", layout) for layout in ("layer_first", "page_first", "page_first_direct", "page_head")]
MATRIX += [("shm", "mla", layout) for layout in ("layer_first", "page_first", "page_first_direct")]
MATRIX += [("frames", "mha", "page_first"), ("frames", "mla", "layer_first")]
IDS = ["-".join(c) for c in MATRIX]
# SGLang 0.5.23's HiCacheStorage, as checked against our backend (a newer SGLang changes this list)
BASE_PUBLIC = [
    "batch_exists",
    "batch_exists_v2",
    "batch_get",
    "batch_get_v1",
    "batch_get_v2",
    "batch_set",
    "batch_set_v1",
    "batch_set_v2",
    "clear",
    "exists",
    "get",
    "get_stats",
    "on_host_pools_registered",
    "register_mem_host_pool_v2",
    "register_mem_pool_host",
    "set",
]


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    if not SGLANG_PYTHON.exists():
        pytest.fail(
            f"SGLang's venv is missing ({SGLANG_PYTHON}): build it with `make setup-sglang` "
            "(sglang==0.5.23 beside torch==2.14.1 in .venv-sglang; `make test` does it)"
        )
    return SGLANG_PYTHON


def docs_extra_config(address: str) -> str:
    """The ``--hicache-storage-backend-extra-config`` of the SGLang section, at ``address``."""
    section = DOCS.read_text().split("## SGLang", 1)[1]
    found = re.search(r"--hicache-storage-backend-extra-config '([^']+)'", section)
    assert found, "no --hicache-storage-backend-extra-config in the SGLang section of docs/integrations.md"
    config = found.group(1)
    assert json.loads(config)["address"] == DOCS_ADDRESS
    return config.replace(DOCS_ADDRESS, address)


def run_harness(python: Path, spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    spec_path, out, log = workdir / f"{name}.spec.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    with log.open("w") as handle:
        proc = subprocess.run(
            [str(python), "-m", "tests.integrations.sglang.sglang_harness.replica", str(spec_path), str(out)],
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode != 0 or "crashed" in result:
        pytest.fail(
            f"SGLang harness {name} exited {proc.returncode}:\n{result.get('crashed', '')}\n{log.read_text()[-6000:]}"
        )
    return result


@pytest.fixture(scope="module")
def runs(
    module_daemon_factory: Callable[..., Daemon], sglang_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    shm = module_daemon_factory()
    frames = module_daemon_factory(shared_memory=False)
    dead = module_daemon_factory()
    dead.kill()
    work = tmp_path_factory.mktemp("sglang")
    spec = {
        "shm": shm.address,
        "frames": frames.address,
        "dead": dead.address,
        "docs_extra_config": docs_extra_config(shm.address),
    }
    a = run_harness(sglang_python, {**spec, "role": "a"}, work, "replica-a")
    b = run_harness(sglang_python, {**spec, "role": "b", "a_matrix": a["matrix"]}, work, "replica-b")
    return {"spec": spec, "a": a, "b": b}


def test_backend_is_a_real_subclass_of_sglangs_hicache_storage(runs: dict[str, Any]) -> None:
    c = runs["a"]["classes"]
    assert c["sglang_version"] == "0.5.23"
    assert c["base_is_sglangs"], "sglang.hicache.HiCacheStorage must be SGLang's class where SGLang is installed"
    assert c["subclass"] and c["ours_abstract"] == [], "instantiable: no abstract method left"
    assert c["base_abstract"] == ["batch_get", "batch_set", "exists", "get", "set"]
    assert c["base_public"] == BASE_PUBLIC, "SGLang's base changed: check the backend against the new methods"
    # what SGLang's controller calls is ours: the plain model's calls and the *_v2
    # calls of hybrid models (test_sglang_hybrid.py)
    assert c["overridden"] == {
        "register_mem_pool_host": True,
        "register_mem_host_pool_v2": True,
        "on_host_pools_registered": False,
        "batch_exists": True,
        "batch_exists_v2": True,
        "batch_get_v1": True,
        "batch_set_v1": True,
        "batch_get_v2": True,
        "batch_set_v2": True,
        "clear": True,
        "get_stats": True,
    }


def test_built_by_sglangs_factory_from_the_documented_extra_config(runs: dict[str, Any]) -> None:
    f = runs["a"]["factory"]
    assert f["type"] == "lmcache_client.integrations.sglang.hicache.LMCacheServerHiCacheStorage"
    assert (f["address"], f["timeout_s"]) == (runs["spec"]["shm"], 2.0)
    assert f["namespace"] == "test/sglang-real|float16|L4|KV2|D32|tp0of1|c16|layout=sglang-page_first"
    assert f["page_bytes"] == 2 * 4 * PAGE * 2 * 32 * 2
    assert f["exists_empty"] == 0
    assert f["with_sglang_keys"] == "LMCacheServerHiCacheStorage", (
        "SGLang's own extra-config keys are not ours to refuse"
    )
    assert f["typo_error"].startswith("ValueError: unknown hicache storage extra config keys ['adress']")


def _entry(runs: dict[str, Any], config: tuple[str, str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    i = MATRIX.index(config)
    a, b = runs["a"]["matrix"][i], runs["b"]["matrix"][i]
    assert (a["daemon"], a["kind"], a["layout"]) == config and b["tenant"] == a["tenant"]
    return a, b


@pytest.mark.parametrize("config", MATRIX, ids=IDS)
def test_pages_round_trip_through_sglangs_cache_controller(runs: dict[str, Any], config: Any) -> None:
    daemon, kind, layout = config
    a, _ = _entry(runs, config)
    assert a["host_pool"] == ("MHATokenToKVPoolHost" if kind == "mha" else "MLATokenToKVPoolHost")
    assert a["page_funcs"] == ["_generic_page_get", "_page_get_zero_copy"], "interface_v1 selects the zero-copy path"
    assert a["set_funcs"] == ["_generic_page_set", "_page_set_zero_copy"]
    assert a["shared_memory"] == [daemon == "shm"] * 2
    assert min(a["clients"]) >= 2, "SGLang's prefetch and backup threads each get their own client"
    ns = a["namespaces"]
    assert ns[0] == ns[1] and f"layout=sglang-{'mla-' if kind == 'mla' else ''}{layout}|" in ns[0]

    # generic replica stores T (5 full pages; the 7 tokens after them are no page)
    assert a["stored_t"]["stored_tokens"] == 5 * PAGE
    digests = a["stored_t"]["digests"]
    assert len(set(digests)) == 5
    # the zero-copy replica finds and loads all of it, byte for byte, at its own slots
    assert a["loaded_t"]["hit_tokens"] == a["loaded_t"]["loaded_tokens"] == 5 * PAGE
    assert a["loaded_t"]["digests"] == digests
    # and back: zero-copy stores U, the generic replica loads it
    assert a["stored_u"]["stored_tokens"] == 4 * PAGE
    assert a["loaded_u"]["hit_tokens"] == a["loaded_u"]["loaded_tokens"] == 4 * PAGE
    assert a["loaded_u"]["digests"] == a["stored_u"]["digests"]


@pytest.mark.parametrize("config", MATRIX, ids=IDS)
def test_a_fresh_replica_loads_what_another_stored(runs: dict[str, Any], config: Any) -> None:
    a, b = _entry(runs, config)
    assert b["t"]["loaded_tokens"] == 5 * PAGE and b["t"]["digests"] == a["stored_t"]["digests"]  # zero-copy read
    assert b["u"]["loaded_tokens"] == 4 * PAGE and b["u"]["digests"] == a["stored_u"]["digests"]  # generic read


def test_leading_pages_only_and_wrong_sizes_refused(runs: dict[str, Any]) -> None:
    r = runs["a"]["partial_and_wrong"]
    assert r["stored_head"] == 2 * PAGE
    assert r["partial"]["hit_tokens"] == r["partial"]["loaded_tokens"] == 2 * PAGE
    # page 1 of 3 replaced by 100 bytes: the lookup counts it, the load stops before it
    for path in ("wrong_page_generic", "wrong_page_zero_copy"):
        assert (r[path]["hit_tokens"], r[path]["loaded_tokens"]) == (3 * PAGE, PAGE), path
    assert r["wrong_page_generic"]["digests"] == r["wrong_page_zero_copy"]["digests"]
    assert r["other_dtype"]["hit_tokens"] == 0 and "|bfloat16|" in r["other_dtype_namespace"]
    assert r["set_short_page"] is False and r["set_count_mismatch"] is False
    assert r["get_short_target"] == [None]
    assert r["v1_wrong_slots"] == "ValueError: 2 pages need 32 host slots, got 5"


def test_dead_daemon_is_a_miss(runs: dict[str, Any]) -> None:
    for path, r in runs["a"]["dead"].items():
        assert r["stored"] == 0, path
        assert (r["loaded"]["hit_tokens"], r["loaded"]["loaded_tokens"]) == (0, 0), path
        assert r["exists"] == 0 and r["clear"] is False, path
        assert r["threads_alive"], f"{path}: SGLang's storage threads must survive a dead daemon"


def test_storage_metrics_are_sglangs_storage_metrics(runs: dict[str, Any]) -> None:
    for path, r in runs["a"]["stats"].items():
        assert r["is_storage_metrics"], path
        assert (r["backup_pgs"], r["prefetch_pgs"]) == ([3], [3]), path
        assert r["bandwidth_counts"] == [1, 1] and r["bandwidth_positive"], path
        assert r["second"] == [[], []], f"{path}: get_stats drains what it reported"
        assert r["without_metrics"] is None, path


def test_what_cannot_work_is_refused_at_start(runs: dict[str, Any]) -> None:
    r = runs["a"]["refusals"]
    assert "stores only the KV, Mamba and SWA pools, not SGLang's draft pool" in r["sidecar_pool"]
    assert r["asymmetric_pool"] == "AsymmetricMHATokenToKVPoolHost"
    assert r["asymmetric"].startswith(
        "ValueError: lmcache-server HiCache storage needs SGLang's flat host pages, "
        "which AsymmetricMHATokenToKVPoolHost (layout page_first) does not offer"
    )
    assert (
        r["dcp"]
        == "ValueError: lmcache-server HiCache storage does not support decode context parallelism (dcp_size > 1)"
    )
    assert r["kv_split_mha"] == "ValueError: Unsupported layout: page_first_kv_split"  # SGLang's own refusal (MLA/NPU)


def test_pinned_host_pools_need_cuda(runs: dict[str, Any]) -> None:
    """SGLang's default host pool (pin_memory=True) registers its buffer with
    cudaHostRegister through torch.cuda.cudart(): that alone needs a GPU here."""
    r = runs["a"]["refusals"]
    if r["cuda_available"]:
        assert r["pinned_host_pool"] is None
    else:
        assert "NVIDIA driver" in r["pinned_host_pool"]


def test_pipeline_stages_and_context_parallel_ranks_do_not_share_pages(runs: dict[str, Any]) -> None:
    r = runs["a"]["shards"]
    assert r["namespaces"]["pp0"].endswith("layout=sglang-page_first-pp0of2|tenant=shards")
    assert r["namespaces"]["pp1"].endswith("layout=sglang-page_first-pp1of2|tenant=shards")
    assert r["namespaces"]["cp1"].endswith("layout=sglang-page_first-cp1of2|tenant=shards")
    assert r["pp0_set"] is True
    assert r["exists"] == {"pp0": 2, "pp1": 0, "cp1": 0}
