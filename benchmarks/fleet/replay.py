"""The open-loop replayer: every request sent at its arrival time, whatever is still running.

One thread per request (stdlib only: the benchmark's process is the main venv), raw
HTTP to vLLM's streaming ``/v1/completions`` (``stream: true``, greedy, ``ignore_eos``,
``max_tokens`` from the workload): the time to the first streamed text is the TTFT,
the time to the end of the stream the end-to-end latency, and the generated text is
kept to compare configurations.  Times are from the request's scheduled arrival, so a
replayer that falls behind shows as latency, never as a lighter load.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Sequence

from .routers import Router
from .trace import Request


@dataclasses.dataclass
class Outcome:
    index: int
    replica: int
    arrival_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    text: str = ""
    prompt_tokens: int | None = None
    """vLLM's count of the prompt (the stream's usage), to check against what was sent."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None


def stream_completion(url: str, model: str, request: Request, timeout_s: float, started: float, out: Outcome) -> None:
    """POST one streaming completion; fills ``out`` (times relative to ``started``)."""
    parts = urllib.parse.urlsplit(url)
    body = {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            out.error = f"HTTP {response.status}: {response.read()[:300]!r}"
            return
        pieces: list[str] = []
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                if choice.get("text") and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - started
                pieces.append(choice.get("text") or "")
            if chunk.get("usage"):
                out.prompt_tokens = chunk["usage"].get("prompt_tokens")
        out.e2e_s = time.monotonic() - started
        out.text = "".join(pieces)
        if out.ttft_s is None:
            out.error = "the stream ended without text"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        out.error = f"{type(err).__name__}: {err}"
    finally:
        conn.close()


class Replayer:
    """Sends a workload to replicas at its arrival times through a router."""

    def __init__(self, urls: Sequence[str], model: str, router: Router, timeout_s: float = 900):
        self.urls, self.model, self.router, self.timeout_s = list(urls), model, router, timeout_s
        self._in_flight = [0] * len(self.urls)
        self._lock = threading.Lock()

    def run(self, requests: Sequence[Request]) -> tuple[list[Outcome], float]:
        """Every request's outcome (in the workload's order) and the wall time of the run."""
        outcomes: list[Outcome] = []
        threads: list[threading.Thread] = []
        t0 = time.monotonic() + 0.2
        for request in requests:
            delay = t0 + request.arrival_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with self._lock:
                replica = self.router.pick(request, self._in_flight)
                self.router.sent(request, replica)
                self._in_flight[replica] += 1
            out = Outcome(request.index, replica, request.arrival_s)
            outcomes.append(out)
            thread = threading.Thread(target=self._send, args=(request, out, t0 + request.arrival_s), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(self.timeout_s)
        return outcomes, time.monotonic() - t0

    def run_serial(self, requests: Sequence[Request], replicas: Sequence[int]) -> list[Outcome]:
        """Each request alone, in order, to ``replicas[i]`` (the replica the open-loop run sent
        it to): greedy outputs without concurrent batching, whose numerics on a CPU depend on
        the batch (two open-loop runs of vLLM alone differ in a few tokens)."""
        outcomes = []
        for request, replica in zip(requests, replicas):
            out = Outcome(request.index, replica, 0.0)
            stream_completion(self.urls[replica], self.model, request, self.timeout_s, time.monotonic(), out)
            outcomes.append(out)
        return outcomes

    def _send(self, request: Request, out: Outcome, scheduled: float) -> None:
        try:
            stream_completion(self.urls[out.replica], self.model, request, self.timeout_s, scheduled, out)
        finally:
            with self._lock:
                self._in_flight[out.replica] -= 1
