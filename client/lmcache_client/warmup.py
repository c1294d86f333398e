"""``lmcache-warmup``: prefill hot system prompts through an engine so their KV is cached.

Sends every prompt of a file to an OpenAI-compatible ``/v1/chat/completions``
endpoint (vLLM, SGLang, ...) with ``max_tokens=1``: the engine prefills the
prompt and its KV connector stores the chunks in the daemon, so the first real
request of each prompt is already warm.  Standard library only.

    lmcache-warmup --endpoint http://127.0.0.1:8000 --model meta-llama/Llama-3.1-8B \\
        --prompts hot_prompts.jsonl --concurrency 4

Prompt file: JSON Lines, one prompt per line, either a string (a system
prompt) or an object with ``system`` (and optionally ``user``) strings, or a
``messages`` list in chat format; or a ``.json`` file holding a list of those.
Blank lines and lines starting with ``#`` are skipped.

API key (sent as ``Authorization: Bearer``): ``--api-key``, else
``$OPENAI_API_KEY``, else ``$VLLM_API_KEY`` (the variable ``vllm serve`` reads its
own key from), else none.  Prefer a variable: a key on the command line is
visible to every user's ``ps``.

Output: a progress bar on stderr, one line per prompt (index, status, latency,
prompt tokens and cached tokens when the server reports them) and a summary on
stdout, and optionally ``--json PATH``.  Exit status: 0 all prompts warmed,
1 some failed, 2 bad arguments or prompt file, 3 endpoint unreachable.

Primitives: :func:`main`, :func:`load_prompts`, :func:`warm`, :func:`api_key` and :class:`Outcome`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
API_KEY_ENVS = ("OPENAI_API_KEY", "VLLM_API_KEY")
"""Where the API key is read from when ``--api-key`` is not given, first set wins."""


class PromptFileError(ValueError):
    """The prompt file cannot be read or a line is not a prompt."""


@dataclasses.dataclass
class Outcome:
    index: int
    ok: bool
    latency_s: float
    error: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    preview: str = ""


# -- prompts -------------------------------------------------------------------------------
def _messages(item: Any, where: str, user_message: str) -> list[dict[str, str]]:
    if isinstance(item, str):
        item = {"system": item}
    if not isinstance(item, dict):
        raise PromptFileError(f"{where}: expected a string or an object, got {type(item).__name__}")
    if "messages" in item:
        messages = item["messages"]
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        )
        if not ok:
            raise PromptFileError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    system = item.get("system")
    if not isinstance(system, str) or not system:
        raise PromptFileError(f"{where}: needs a non-empty 'system' string or a 'messages' list")
    user = item.get("user", user_message)
    if not isinstance(user, str):
        raise PromptFileError(f"{where}: 'user' must be a string")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def load_prompts(path: Path, user_message: str = "Hi") -> list[list[dict[str, str]]]:
    """The chat messages of every prompt in ``path``; raises PromptFileError with the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PromptFileError(f"cannot read prompt file {path}: {err}") from err
    prompts: list[list[dict[str, str]]] = []
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{path}: not valid JSON: {err}") from err
        if not isinstance(items, list):
            raise PromptFileError(f"{path}: a .json prompt file must hold a list")
        prompts = [_messages(item, f"{path} item {i}", user_message) for i, item in enumerate(items)]
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{path} line {number}: not valid JSON ({err.msg})") from err
            prompts.append(_messages(item, f"{path} line {number}", user_message))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


# -- HTTP ----------------------------------------------------------------------------------
def completions_url(endpoint: str) -> str:
    """``http://host:port`` or ``.../v1`` or the full URL -> the chat-completions URL."""
    url = endpoint.rstrip("/")
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"endpoint must be an http(s) URL, got {endpoint!r}")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def check_reachable(url: str, timeout_s: float) -> str | None:
    """None when a TCP connection to the endpoint opens, else why not."""
    parsed = urllib.parse.urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            return None
    except OSError as err:
        return f"{parsed.hostname}:{port}: {err.strerror or err}"


def _post(url: str, body: dict[str, Any], api_key: str, timeout_s: float) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        reply = json.loads(response.read())
    if not isinstance(reply, dict) or "choices" not in reply:
        raise ValueError("the reply is not a chat completion")
    return reply


def _error_text(err: Exception) -> str:
    if isinstance(err, urllib.error.HTTPError):
        detail = err.read(300).decode(errors="replace").strip()
        return f"HTTP {err.code} {err.reason}" + (f": {detail}" if detail else "")
    if isinstance(err, urllib.error.URLError):
        return f"connection failed: {err.reason}"
    if isinstance(err, TimeoutError | socket.timeout):
        return "timed out"
    return f"{type(err).__name__}: {err}"


def warm_one(
    index: int, messages: list[dict[str, str]], url: str, model: str, api_key: str, timeout_s: float, max_tokens: int
) -> Outcome:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    preview = " ".join(messages[0]["content"].split())[:48]
    started = time.perf_counter()
    try:
        reply = _post(url, body, api_key, timeout_s)
    except (OSError, ValueError) as err:
        return Outcome(index, False, time.perf_counter() - started, _error_text(err), preview=preview)
    latency = time.perf_counter() - started
    usage = reply.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(index, True, latency, "", usage.get("prompt_tokens"), details.get("cached_tokens"), preview)


# -- progress --------------------------------------------------------------------------------
class Progress:
    """A bar redrawn in place on a terminal, one line per prompt otherwise (logs, CI)."""

    def __init__(self, total: int, stream: TextIO):
        self.total = total
        self.stream = stream
        self.done = 0
        self.failed = 0
        self.started = time.perf_counter()
        self.tty = stream.isatty()
        self._lock = threading.Lock()

    def update(self, outcome: Outcome) -> None:
        with self._lock:
            self.done += 1
            self.failed += not outcome.ok
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            elapsed = time.perf_counter() - self.started
            line = f"[{bar}] {self.done}/{self.total} failed={self.failed} {elapsed:.1f}s"
            if self.tty:
                self.stream.write("\r" + line + ("\n" if self.done == self.total else ""))
            else:
                status = "ok" if outcome.ok else f"FAILED ({outcome.error})"
                self.stream.write(f"{line}  prompt {outcome.index}: {status} {outcome.latency_s:.3f}s\n")
            self.stream.flush()


def warm(
    prompts: Sequence[list[dict[str, str]]],
    send: Callable[[int, list[dict[str, str]]], Outcome],
    concurrency: int,
    progress: Progress,
) -> list[Outcome]:
    """Send every prompt with at most ``concurrency`` requests in flight."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(send, i, messages) for i, messages in enumerate(prompts)]
        outcomes = []
        for future in concurrent.futures.as_completed(futures):
            outcome = future.result()
            progress.update(outcome)
            outcomes.append(outcome)
    return sorted(outcomes, key=lambda o: o.index)


# -- report ----------------------------------------------------------------------------------
def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(outcomes: list[Outcome], wall_s: float, out: TextIO) -> dict[str, Any]:
    out.write(f"{'#':>4}  {'status':<6}  {'latency_s':>9}  {'prompt_tok':>10}  {'cached_tok':>10}  prompt\n")
    for o in outcomes:
        tokens = "-" if o.prompt_tokens is None else str(o.prompt_tokens)
        cached = "-" if o.cached_tokens is None else str(o.cached_tokens)
        status = "ok" if o.ok else "FAILED"
        out.write(f"{o.index:>4}  {status:<6}  {o.latency_s:>9.3f}  {tokens:>10}  {cached:>10}  {o.preview}\n")
        if not o.ok:
            out.write(f"{'':>4}  error: {o.error}\n")
    ok = [o.latency_s for o in outcomes if o.ok]
    summary: dict[str, Any] = {
        "prompts": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "wall_s": round(wall_s, 3),
    }
    if ok:
        summary.update(
            latency_min_s=round(min(ok), 4),
            latency_median_s=round(statistics.median(ok), 4),
            latency_p90_s=round(_quantile(ok, 0.9), 4),
            latency_max_s=round(max(ok), 4),
        )
    line = f"summary: {summary['ok']}/{summary['prompts']} prompts warmed, {summary['failed']} failed, {wall_s:.2f}s"
    if ok:
        line += (
            f"; latency min {summary['latency_min_s']:.3f}s median {summary['latency_median_s']:.3f}s"
            f" p90 {summary['latency_p90_s']:.3f}s max {summary['latency_max_s']:.3f}s"
        )
    out.write(line + "\n")
    return summary


# -- command line ----------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def api_key(flag: str | None, environ: Mapping[str, str]) -> str:
    """``--api-key``, else the first of :data:`API_KEY_ENVS` set (not empty), else "" (no header)."""
    if flag is not None:
        return flag
    return next((environ[name] for name in API_KEY_ENVS if environ.get(name)), "")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lmcache-warmup",
        description="Prefill hot system prompts through an OpenAI-compatible endpoint so their KV is cached.",
    )
    parser.add_argument("--endpoint", required=True, help="e.g. http://127.0.0.1:8000 (or .../v1)")
    parser.add_argument("--model", required=True, help="the model name the endpoint serves")
    parser.add_argument("--prompts", required=True, type=Path, help="JSON Lines (or .json list) of prompts")
    parser.add_argument("--concurrency", type=_positive_int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--timeout-s", type=_positive_float, default=120.0, help="per request (default 120)")
    parser.add_argument("--max-tokens", type=_positive_int, default=1, help="tokens to generate (default 1)")
    parser.add_argument("--user-message", default="Hi", help="user turn after a bare system prompt (default 'Hi')")
    parser.add_argument(
        "--api-key",
        help="sent as a Bearer token (default: $OPENAI_API_KEY, else $VLLM_API_KEY; prefer those: ps shows argv)",
    )
    parser.add_argument("--json", type=Path, dest="json_path", help="write outcomes and summary here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        args = parse_args(argv)
    except SystemExit as exit_:
        return EXIT_USAGE if exit_.code else EXIT_OK
    try:
        url = completions_url(args.endpoint)
        prompts = load_prompts(args.prompts, args.user_message)
    except (PromptFileError, ValueError) as error:
        err.write(f"lmcache-warmup: {error}\n")
        return EXIT_USAGE
    problem = check_reachable(url, min(args.timeout_s, 10.0))
    if problem is not None:
        err.write(f"lmcache-warmup: endpoint {args.endpoint} is unreachable ({problem})\n")
        return EXIT_UNREACHABLE
    err.write(f"warming {len(prompts)} prompts at {url} with concurrency {args.concurrency}\n")

    key = api_key(args.api_key, os.environ)

    def send(index: int, messages: list[dict[str, str]]) -> Outcome:
        return warm_one(index, messages, url, args.model, key, args.timeout_s, args.max_tokens)

    started = time.perf_counter()
    outcomes = warm(prompts, send, args.concurrency, Progress(len(prompts), err))
    summary = report(outcomes, time.perf_counter() - started, out)
    if args.json_path is not None:
        rows = [dataclasses.asdict(o) for o in outcomes]
        args.json_path.write_text(json.dumps({"summary": summary, "prompts": rows}, indent=2) + "\n")
    return EXIT_OK if summary["failed"] == 0 else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
