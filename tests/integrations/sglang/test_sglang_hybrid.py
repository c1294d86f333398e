"""SGLang hybrid models (SWA and Mamba host pools) through the v2 storage calls (sglang 0.5.23, CPU).

tests/integrations/sglang/sglang_harness/hybrid.py builds, in SGLang's venv, two
replicas with SGLang's own host pool group of a hybrid model (full-attention
KV anchor, SWA KV, Mamba state) and its ``HybridCacheController``, which
attaches our backend and registers every pool; A stores with
``batch_set_v2``, B asks ``batch_exists_v2`` and loads with ``batch_get_v2``,
against a real daemon.  The radix tree that picks the pages (a served model)
is not run.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ...conftest import Daemon
from .test_sglang_real import ROOT, sglang_python  # noqa: F401

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def hybrid(
    module_daemon_factory: Callable[..., Daemon],
    sglang_python: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    daemon = module_daemon_factory()
    gone = module_daemon_factory()
    gone.kill()
    work = tmp_path_factory.mktemp("sglang-hybrid")
    spec, out, log = work / "spec.json", work / "out.json", work / "hybrid.log"
    spec.write_text(json.dumps({"address": daemon.address, "dead": gone.address}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    with log.open("w") as handle:
        proc = subprocess.run(
            [str(sglang_python), "-m", "tests.integrations.sglang.sglang_harness.hybrid", str(spec), str(out)],
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=500,
        )
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode != 0 or "crashed" in result:
        pytest.fail(f"hybrid harness exited {proc.returncode}:\n{result.get('crashed', '')}\n{log.read_text()[-6000:]}")
    return result


def test_every_pool_round_trips_byte_for_byte(hybrid: dict[str, Any]) -> None:
    assert hybrid["stored"] == {"kv": [True] * 4, "swa": [True, True], "mamba": [True, True]}
    assert hybrid["loaded"] == {"kv": [True] * 4, "swa": [True, True], "mamba": [True, True]}
    assert hybrid["same"] == {"kv": [True] * 4, "swa": [True, True], "mamba": [True, True]}


def test_side_pools_have_namespaces_of_their_own(hybrid: dict[str, Any]) -> None:
    ns, sizes = hybrid["namespaces"], hybrid["page_bytes"]
    assert len(set(ns.values())) == 3
    # KV: 4 layers x K,V x 16 tokens x 2 heads x 32 dims x fp16; SWA: 2 layers of the same;
    # Mamba: 3 layers x (SSM 2x16x16 fp32 + conv 3x96 bf16), one state per slot
    assert sizes == {"kv": 16384, "swa": 8192, "mamba": 3 * (2 * 16 * 16 * 4 + 3 * 96 * 2)}
    swa_layout = "|layout=sglang-page_first+pool=swa-L2-P16-B8192|"
    assert ns["swa"] == ns["kv"].replace("|layout=sglang-page_first|", swa_layout)
    assert ns["mamba"] == ns["kv"].replace("|float16|", "|bfloat16|").replace(
        "|layout=sglang-page_first|", "|layout=sglang-page_first+pool=mamba-L3-P1-B7872|"
    )
    # the same page hashes, three key spaces: each holds exactly what was stored in it
    assert hybrid["present"] == {
        "kv": [True] * 4,
        "swa": [False, False, True, True],
        "mamba": [False, True, False, True],
    }


def test_hit_policies_give_the_prefixes_every_pool_can_restore(hybrid: dict[str, Any]) -> None:
    # 4 KV pages; SWA (its last 2 pages) restores only 4, Mamba (the state at its end)
    # 2 and 4: the usable prefix is 4 pages
    assert hybrid["exists_full"] == {"kv": 4, "pools": {"kv": 4, "swa": 4, "mamba": 4}, "restorable": [4]}
    # 3 KV pages, but SWA lacks page 2 (and Mamba a state after 3): no usable prefix, never
    # one with a missing or wrong state (SGLang then recomputes)
    assert hybrid["exists_three_pages"] == {"kv": 0, "pools": {"kv": 3}, "restorable": []}
    # another prompt sharing 2 pages: 2 KV pages, SWA lacks pages 1-2
    assert hybrid["exists_other_tail"] == {"kv": 0, "pools": {"kv": 2}, "restorable": []}
    # Mamba alone over 3 pages: its states are after pages 2 and 4, so 2 pages are usable
    assert hybrid["exists_three_pages_mamba_only"] == {"kv": 2, "pools": {"kv": 3, "mamba": 2}, "restorable": [2]}


def test_mla_shares_kv_across_ranks_but_not_the_mamba_state(hybrid: dict[str, Any]) -> None:
    r = hybrid["mla_tp"]
    assert "|tp0of1|" in r["kv"] and "|tp0of1|" in r["swa"]
    assert "|tp1of2|" in r["mamba"]


def test_other_side_pools_are_refused(hybrid: dict[str, Any]) -> None:
    assert hybrid["refused_pool"] == (
        "ValueError: lmcache-server HiCache storage stores only the KV, Mamba and SWA pools, not SGLang's "
        "indexer pool (MHATokenToKVPoolHost): DSA indexer, DeepSeek V4 and draft sidecars are not supported"
    )


def test_a_side_page_of_another_size_is_not_loaded(hybrid: dict[str, Any]) -> None:
    r = hybrid["wrong_size"]
    assert r["put"] == [0]
    assert r["loaded"] == {"mamba": [False]} and r["untouched"]


def test_a_dead_daemon_is_a_miss_for_every_pool(hybrid: dict[str, Any]) -> None:
    r = hybrid["dead"]
    assert r["set"] == {"kv": [False] * 4, "swa": [False, False], "mamba": [False, False]}
    assert r["exists"] == [0, {}]
    assert r["get"] == {"swa": [False, False], "mamba": [False, False]}
