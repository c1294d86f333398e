"""NVIDIA Dynamo's standalone KV indexer, run as a process from its PyPI wheel.

``make setup-dynamo`` builds ``.venv-dynamo`` (``ai-dynamo-runtime``, CPU-only,
no torch); ``LMCACHE_DYNAMO_PYTHON`` names another python that has it.  A
missing venv fails the tests with the command that builds it (as vLLM's does;
the fixtures are in this folder's conftest.py); it never skips them.

``python -m dynamo.indexer`` is Dynamo's own indexer service
(``lib/kv-router/src/services/indexer/`` in ai-dynamo/dynamo): for every worker
registered with ``POST /register`` it subscribes to the worker's vLLM-format
ZeroMQ KV-event stream, converts each event with Dynamo's own relay code
(``convert_event``: ``block_hashes``/``parent_block_hash`` as external ids, one
``tokens_hash`` per block recomputed from ``token_ids``, ``medium`` -> storage
tier), feeds its radix tree, asks the worker's replay endpoint for batches it
missed (a gap in ``seq``), and answers ``POST /query`` (token ids -> overlap per
instance and tier, in tokens: ``longest_matched``, ``gpu``, ``cpu`` and ``disk``
cumulative through the tiers before them; ``lib/kv-router/src/services/overlap.rs``).
Nothing here reimplements any of that: the tests talk to the process over HTTP.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ...conftest import free_port

ROOT = Path(__file__).resolve().parents[3]
DYNAMO_PYTHON = Path(os.environ.get("LMCACHE_DYNAMO_PYTHON", ROOT / ".venv-dynamo" / "bin" / "python"))


class DynamoIndexer:
    """One ``python -m dynamo.indexer`` process on a loopback-reachable port (it binds 0.0.0.0)."""

    def __init__(self, python: Path, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"dynamo-indexer-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - held open for the process's lifetime
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "LMCACHE_"))}
        env["NO_COLOR"] = "1"
        self.proc = subprocess.Popen(
            [str(python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.call("GET", "/workers")
                return
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dynamo.indexer did not answer:\n{self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"{method} {path}: HTTP {err.code} {err.read()!r}") from None

    def register(
        self, instance_id: int, endpoint: str, model: str, block_size: int, replay_endpoint: str | None = None
    ) -> None:
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": model,
            "block_size": block_size,
        }
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        assert self.call("POST", "/register", body) == {"status": "ok"}

    def listening(self, instance_id: int) -> bool:
        """The worker's ZeroMQ listener is connected (its status ``active``)."""
        for worker in self.call("GET", "/workers"):
            if worker["instance_id"] == instance_id:
                return all(listener["status"] == "active" for listener in worker["listeners"].values())
        return False

    def overlap(self, model: str, token_ids: list[int]) -> dict[int, dict[str, Any]]:
        """``POST /query``: per instance id, ``{longest_matched, gpu, cpu, disk, dp}`` in tokens."""
        answer = self.call("POST", "/query", {"token_ids": token_ids, "model_name": model})
        return {int(k): v for k, v in answer["instances"].items()}

    def longest(self, model: str, token_ids: list[int], instance_id: int) -> int:
        """Tokens of ``token_ids`` Dynamo believes ``instance_id`` holds, over all tiers."""
        summary = self.overlap(model, token_ids).get(instance_id)
        return int(summary["longest_matched"]) if summary else 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
