"""``lmcache-server admin who-has``: ask several nodes' ``POST /query`` which holds
the longest prefix of a prompt, and print the best (docs/events.md, "Query").

    lmcache-server admin who-has --nodes http://a:9464,http://b:9464 \\
        --model meta-llama/Llama-3.1-8B --tokens 1,2,3,...

A daemon with ``query_tokens_file`` answers only a bearer token
(docs/security.md): ``--token-file FILE`` (the token on one line), else the
``LMCACHE_QUERY_TOKEN`` environment variable; never on the command line,
where other users' ``ps`` would read it.

The nodes are asked at once (one thread each, ``--timeout`` seconds); a node
that does not answer, or answers an error, is listed with it.  The best node
holds the longest prefix; a tie goes to the one holding more of it in memory.
``--json`` prints every answer.  Exit codes: 0 some node holds a prefix, 1 none
does (or none answered), 2 bad usage or input.

Primitive: :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .admincache import PromptError, add_target, read_tokens


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-server admin who-has",
        description="Ask several nodes which holds the longest cached prefix of a prompt.",
    )
    p.add_argument("--nodes", required=True, metavar="URLS", help="the nodes' metrics URLs: http://a:9464,...")
    add_target(p)  # --namespace NS | --model MODEL, as every cache command takes them
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--tokens", metavar="IDS", help="the prompt's token ids: 1,2,3")
    given.add_argument("--tokens-file", metavar="FILE", help="token ids separated by commas/space, or JSON")
    p.add_argument("--lora", help="the LoRA adapter's name (part of the chain root)")
    p.add_argument("--salt", help="the request's cache_salt")
    p.add_argument("--tags", help="lmcache_tags, separated by commas")
    p.add_argument("--token-file", metavar="FILE", help="a /query bearer token (default: $LMCACHE_QUERY_TOKEN)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per node (default 5)")
    p.add_argument("--json", action="store_true", help="print every node's answer as JSON")
    return p


def ask(url: str, body: dict[str, Any], timeout: float, token: str | None = None) -> dict[str, Any]:
    """One node's answer, or ``{"error": ...}``."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url.rstrip("/") + "/query", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
            return answer
    except urllib.error.HTTPError as err:
        try:
            why = json.loads(err.read()).get("error", err.reason)
        except ValueError:
            why = err.reason
        return {"error": f"{err.code}: {why}"}
    except (urllib.error.URLError, OSError, ValueError) as err:
        return {"error": str(getattr(err, "reason", err))}


def _token(path: str | None) -> str | None:
    """The bearer token: the file's first line, else ``$LMCACHE_QUERY_TOKEN``, else None."""
    if path is None:
        return os.environ.get("LMCACHE_QUERY_TOKEN") or None
    with open(path, encoding="utf-8") as f:
        return f.readline().strip() or None


def _rank(answer: dict[str, Any]) -> tuple[int, int, int]:
    """Longest prefix first; then more of it on the node itself (not only in the shared
    Redis tier, ``REMOTE``, which every node sharing it reads alike); then more in memory."""
    best = answer.get("best") or {}
    media = best.get("by_medium", {})
    prefix = best.get("prefix_tokens", 0)
    return prefix, prefix - media.get("REMOTE", 0), media.get("CPU", 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.text = args.tokenizer = None
    try:
        tokens = read_tokens(args)
    except PromptError as err:
        print(f"who-has: {err}", file=sys.stderr)
        return 2
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    if not nodes:
        print("who-has: --nodes names no node", file=sys.stderr)
        return 2
    body: dict[str, Any] = {"tokens": tokens}
    body.update({k: v for k in ("namespace", "model", "lora", "salt") if (v := getattr(args, k)) is not None})
    if args.tags:
        body["tags"] = [t.strip() for t in args.tags.split(",") if t.strip()]
    try:
        token = _token(args.token_file)
    except OSError as err:
        print(f"who-has: --token-file: {err}", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        answers = dict(zip(nodes, pool.map(lambda n: ask(n, body, args.timeout, token), nodes)))
    ranked = sorted((n for n in nodes if "error" not in answers[n]), key=lambda n: _rank(answers[n]), reverse=True)
    best = ranked[0] if ranked and _rank(answers[ranked[0]])[0] > 0 else None
    if args.json:
        print(json.dumps({"best": best, "tokens": len(tokens), "nodes": answers}, indent=2, sort_keys=True))
    else:
        for node in nodes:
            a = answers[node]
            if "error" in a:
                print(f"{node}: error {a['error']}")
                continue
            b = a["best"]
            media = ", ".join(f"{m} {n}" for m, n in sorted(b["by_medium"].items())) or "-"
            print(f"{node}: {b['prefix_tokens']} of {len(tokens)} tokens ({media}) in {b['namespace']}")
        print(f"best: {best}" if best else "best: none (no node holds a prefix)")
    return 0 if best else 1
