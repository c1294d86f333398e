"""lmcache-warmup against a small local chat-completions server (real HTTP on loopback)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from lmcache_client import warmup

from ..conftest import free_port

REPO = Path(__file__).resolve().parents[2]


class ChatServer:
    """Speaks the OpenAI chat-completions shape; fails prompts containing FAIL, and
    records every request and the most requests it had in flight at once.

    A request counts as in flight from when its body has been read until just
    before the last bytes of its reply are written: inside the interval in which
    the client counts it, so the maximum seen here never exceeds the client's
    concurrency, however late the handler thread gets to finish."""

    def __init__(self, delay_s: float = 0.05, linger_s: float = 0.0, api_key: str | None = None):
        self.delay_s = delay_s
        self.api_key = api_key
        """When set, a request without ``Authorization: Bearer <api_key>`` gets 401, as vLLM's --api-key."""
        # A handler thread that is slow to finish after its reply is written
        # (as on a busy machine); the client may already have sent its next request.
        self.linger_s = linger_s
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            counted = False

            def do_POST(self) -> None:
                try:
                    server.handle(self)
                    time.sleep(server.linger_s)
                finally:
                    server.leave(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        if h.path != "/v1/chat/completions":
            self.reply(h, 404, {"error": {"message": f"no route {h.path}"}})
            return
        if self.api_key is not None and h.headers.get("Authorization") != f"Bearer {self.api_key}":
            h.rfile.read(int(h.headers["Content-Length"]))
            self.reply(h, 401, {"error": {"message": "invalid api key"}})
            return
        body = json.loads(h.rfile.read(int(h.headers["Content-Length"])))
        with self._lock:
            self.requests.append(body)
            h.counted = True  # type: ignore[attr-defined]
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        time.sleep(self.delay_s)
        system = body["messages"][0]["content"]
        if "FAIL" in system:
            self.reply(h, 500, {"error": {"message": "model exploded"}})
            return
        prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        self.reply(
            h,
            200,
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": 1,
                    "total_tokens": prompt_tokens + 1,
                    "prompt_tokens_details": {"cached_tokens": 16},
                },
            },
        )

    def leave(self, h: BaseHTTPRequestHandler) -> None:
        """The request ``h`` is no longer in flight (once, if it was counted)."""
        with self._lock:
            if getattr(h, "counted", False):
                h.counted = False  # type: ignore[attr-defined]
                self.in_flight -= 1

    def reply(self, h: BaseHTTPRequestHandler, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        # The client cannot see the reply complete (and send its next request)
        # before these bytes are written: count the request done first.
        self.leave(h)
        h.wfile.write(data)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    server = ChatServer(linger_s=0.1)
    yield server
    server.close()


def write_prompts(path: Path, items: list[Any]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = warmup.main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_warms_every_prompt_with_bounded_concurrency(chat_server: ChatServer, tmp_path: Path) -> None:
    items: list[Any] = [f"You are assistant number {i}. " * 20 for i in range(10)]
    items.append({"system": "You review code.", "user": "Ready?"})
    items.append({"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Go"}]})
    prompts = write_prompts(tmp_path / "hot.jsonl", items)
    report = tmp_path / "report.json"
    code, out, err = run(
        "--endpoint", chat_server.url, "--model", "m", "--prompts", str(prompts),
        "--concurrency", "3", "--json", str(report),
    )  # fmt: skip
    assert code == warmup.EXIT_OK, err
    assert len(chat_server.requests) == 12
    assert 1 < chat_server.max_in_flight <= 3
    sent = {json.dumps(r["messages"]) for r in chat_server.requests}
    assert (
        json.dumps([{"role": "system", "content": "You review code."}, {"role": "user", "content": "Ready?"}]) in sent
    )
    assert json.dumps([{"role": "system", "content": items[0]}, {"role": "user", "content": "Hi"}]) in sent
    assert all(r["model"] == "m" and r["max_tokens"] == 1 for r in chat_server.requests)
    # stderr: progress, one line per prompt when not a terminal; stdout: per-prompt table and summary.
    assert err.count("/12 failed=") == 12 and "[" + "#" * 30 + "] 12/12 failed=0" in err
    lines = out.splitlines()
    assert lines[0].split() == ["#", "status", "latency_s", "prompt_tok", "cached_tok", "prompt"]
    assert [line.split()[1] for line in lines[1:13]] == ["ok"] * 12
    assert lines[-1].startswith("summary: 12/12 prompts warmed, 0 failed") and "median" in lines[-1]
    data = json.loads(report.read_text())
    assert data["summary"]["ok"] == 12 and data["summary"]["latency_median_s"] >= 0.05
    assert data["prompts"][0]["cached_tokens"] == 16 and data["prompts"][0]["prompt_tokens"] > 20


def test_failures_are_reported_and_exit_nonzero(chat_server: ChatServer, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", ["fine", "this one will FAIL", "also fine"])
    code, out, err = run("--endpoint", chat_server.url + "/v1", "--model", "m", "--prompts", str(prompts))
    assert code == warmup.EXIT_FAILED
    assert "FAILED (HTTP 500" in err and "model exploded" in out
    assert "summary: 2/3 prompts warmed, 1 failed" in out


def test_unreachable_endpoint_is_a_clear_error(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", ["hello"])
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = run("--endpoint", url, "--model", "m", "--prompts", str(prompts))
    assert code == warmup.EXIT_UNREACHABLE and out == ""
    assert f"endpoint {url} is unreachable" in err and "refused" in err.lower()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('"ok"\n{not json\n', "line 2: not valid JSON"),
        ('{"user": "no system"}\n', "line 1: needs a non-empty 'system' string or a 'messages' list"),
        ('{"messages": [{"role": "system"}]}\n', "'messages' must be a non-empty list"),
        ("\n# only a comment\n", "no prompts"),
        ("42\n", "line 1: expected a string or an object, got int"),
    ],
)
def test_bad_prompt_file_names_the_line(chat_server: ChatServer, tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    code, _, err = run("--endpoint", chat_server.url, "--model", "m", "--prompts", str(path))
    assert code == warmup.EXIT_USAGE
    assert message in err and str(path) in err
    assert chat_server.requests == []


def test_missing_file_json_list_and_bad_endpoint(chat_server: ChatServer, tmp_path: Path) -> None:
    code, _, err = run("--endpoint", chat_server.url, "--model", "m", "--prompts", str(tmp_path / "nope.jsonl"))
    assert code == warmup.EXIT_USAGE and "cannot read prompt file" in err
    listed = tmp_path / "prompts.json"
    listed.write_text(json.dumps(["a", {"system": "b"}]))
    code, out, _ = run("--endpoint", chat_server.url, "--model", "m", "--prompts", str(listed))
    assert code == warmup.EXIT_OK and "2/2 prompts warmed" in out
    code, _, err = run("--endpoint", "ftp://x", "--model", "m", "--prompts", str(listed))
    assert code == warmup.EXIT_USAGE and "http(s) URL" in err
    assert run("--model", "m")[0] == warmup.EXIT_USAGE  # argparse: --endpoint missing


def test_console_script_is_declared_and_runs(chat_server: ChatServer, tmp_path: Path) -> None:
    scripts = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lmcache-warmup"] == "lmcache_client.warmup:main"
    prompts = write_prompts(tmp_path / "p.jsonl", ["one", "two"])
    argv = [sys.executable, "-m", "lmcache_client.warmup", "--endpoint", chat_server.url, "--model", "m"]
    proc = subprocess.run([*argv, "--prompts", str(prompts)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "summary: 2/2 prompts warmed" in proc.stdout and "2/2 failed=0" in proc.stderr


@pytest.mark.parametrize("variable", ["OPENAI_API_KEY", "VLLM_API_KEY"])
def test_the_api_key_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """A key on argv is visible in ``ps``: the variables give it too; a flag still wins."""
    server = ChatServer(delay_s=0.0, api_key="sk-right")
    try:
        for name in ("OPENAI_API_KEY", "VLLM_API_KEY"):
            monkeypatch.delenv(name, raising=False)
        argv = ("--endpoint", server.url, "--model", "m", "--prompts", str(write_prompts(tmp_path / "p.jsonl", ["a"])))
        code, out, _ = run(*argv)
        assert code == warmup.EXIT_FAILED and "HTTP 401" in out  # no key at all: the server refuses
        monkeypatch.setenv(variable, "sk-right")
        code, out, err = run(*argv)
        assert code == warmup.EXIT_OK, out + err
        assert run(*argv, "--api-key", "sk-wrong")[0] == warmup.EXIT_FAILED  # the flag beats the variable
        assert server.requests and len(server.requests) == 1  # only the authorized one reached the model
    finally:
        server.close()


def test_openai_api_key_is_read_before_vllm_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = ChatServer(delay_s=0.0, api_key="sk-client")
    try:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-client")
        monkeypatch.setenv("VLLM_API_KEY", "sk-other")
        prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
        argv = [sys.executable, "-m", "lmcache_client.warmup", "--endpoint", server.url, "--model", "m"]
        proc = subprocess.run([*argv, "--prompts", str(prompts)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "sk-client" not in proc.stdout + proc.stderr  # the key is never printed
    finally:
        server.close()
