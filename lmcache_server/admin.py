"""Admin commands over the wire protocol: ``lmcache-server admin COMMAND [options]``.

Commands:

- ``ping``: one round trip; prints the latency.
- ``health``: ping + hello (version, tiers) + the daemon's ``/readyz``; exit 1
  unless it answers and is ready (for scripts and probes).
- ``stats``: tiers, lookups, prefetches and the in-flight budget as a table (``--json``:
  the raw ``stats`` reply); ``--namespace NS`` adds that namespace's counts.
- ``namespaces``: every namespace with its chunks and bytes per tier.
- ``clear``: drop one namespace's chunks (``--namespace NS``) or every chunk
  (``--all --yes``).
- ``pin`` / ``unpin`` / ``delete`` / ``prefetch`` of a prompt's chunks, and
  ``namespace`` (what one namespace holds), each of ``--namespace NS`` or
  ``--model M``: the operator's cache API, admincache.py.
- ``who-has``: which of several nodes holds the longest prefix of a prompt
  (their HTTP ``POST /query``; adminwhohas.py, dispatched before this parser).

The daemon is found from ``--address``, else ``$LMCACHE_SERVER_ADDRESS`` (the
variable the vLLM connector reads), else from the config the daemon uses
(``--config``, ``LMCACHE_CONFIG``, ``LMCACHE_*`` variables: its first
``listen`` endpoint, a wildcard host replaced by loopback).  A daemon with
``auth: curve`` needs ``--client-secret-key`` (a key with the admin role for
``clear --all``, ``namespaces`` and ``stats`` without ``--namespace``) and the
daemon's public key: ``--server-public-key``, else read from the config's
``server_secret_key_file`` (its ``.key`` sibling, or the file itself).

Exit codes: 0 done, 1 daemon unreachable / not ready / error reply, 2 bad usage,
bad prompt input or a refused config.  Primitives: :func:`main`, :func:`daemon_address`,
:func:`target_address`, :func:`metrics_url`, :func:`format_stats`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from lmcache_client import CacheClient, ClientError, DaemonUnavailable
from lmcache_client.connection import ADDRESS_ENV
from lmcache_client.curve import KeyFileError, read_public_key

from .admincache import NoNamespace, PromptError, add_commands, run_command
from .config import ConfigError, ServerConfig, load_config

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "[::]": "[::1]", "::": "[::1]", "": "127.0.0.1"}


def daemon_address(config: ServerConfig) -> str:
    """The endpoint to connect to: the first ``listen`` one, with a wildcard host made loopback."""
    endpoint = config.listen[0]
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        return f"tcp://{_WILDCARDS.get(host, host)}:{port}"
    return endpoint


class UsageError(ValueError):
    """A flag or variable with a value the admin cannot use: exit 2 with this message."""


def target_address(flag: str | None, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The endpoint named by ``--address``, else by ``$LMCACHE_SERVER_ADDRESS`` (None: take
    the config's), and where it came from; UsageError for one that is not a ZeroMQ endpoint
    (which ``connect`` would refuse with a bare "Invalid argument")."""
    for value, source in ((flag, "--address"), (environ.get(ADDRESS_ENV) or None, ADDRESS_ENV)):
        if value is None:
            continue
        host, sep, port = value.removeprefix("tcp://").rpartition(":")
        tcp_ok = value.startswith("tcp://") and sep and host and port.isdigit() and 0 < int(port) < 65536
        if not (tcp_ok or (value.startswith("ipc://") and len(value) > len("ipc://"))):
            raise UsageError(f"{source}: {value!r} is not an endpoint: tcp://HOST:PORT or ipc:///PATH")
        return value, source
    return None, "the config's listen"


def metrics_url(config: ServerConfig) -> str | None:
    """Base URL of the daemon's HTTP endpoint, None when it is disabled."""
    if not config.metrics_port:
        return None
    host = _WILDCARDS.get(config.metrics_host, config.metrics_host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{config.metrics_port}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [list(header)] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    # The first column (a name) is left-aligned, numbers right-aligned.
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]


def format_stats(stats: dict[str, Any], address: str) -> str:
    """The ``stats`` reply as a readable report."""
    server = stats.get("server", {})
    tiers: dict[str, dict[str, Any]] = stats.get("tiers", {})
    up = f", up {server['uptime_s']:.0f}s" if "uptime_s" in server else ""
    lines = [
        f"lmcache-server {server.get('version', '?')} at {address}{up}, chunk_size {server.get('chunk_size', '?')}",
        "",
    ]
    if stats.get("scope") == "namespace":  # a tenant key: its namespace only
        ns = dict(stats["namespace"])
        lines.append(f"namespace {ns.pop('name')}: " + ", ".join(f"{k} {v}" for k, v in ns.items()))
        lines.append("(daemon-wide figures are shown to admin keys only)")
        return "\n".join(lines)
    rows = []
    for name, t in tiers.items():
        capacity = t.get("capacity_bytes")
        used = t.get("allocated_bytes", t.get("disk_bytes", t.get("stored_bytes")))
        state = "" if "up" not in t else ("up" if t["up"] else "DOWN")
        if t.get("degraded"):
            state = "degraded"
        rows.append(
            [
                name,
                t.get("chunks"),
                human_bytes(t["stored_bytes"]) if "stored_bytes" in t else None,
                human_bytes(capacity) if capacity else None,
                _percent(used, capacity) if capacity and used is not None else None,
                t.get("hits", 0),
                t.get("misses", 0),
                _percent(t.get("hits", 0), t.get("hits", 0) + t.get("misses", 0)),
                t.get("evictions"),
                t.get("promotions"),
                t.get("spills"),
                t.get("queued_writes", t.get("queued_spills")),
                t.get("dropped_writes", t.get("spills_dropped")),
                state or "ok",
            ]
        )
    header = ["tier", "chunks", "stored", "capacity", "used", "hits", "misses", "hit rate"]
    header += ["evictions", "promotions", "spills", "queued", "dropped", "state"]
    lines += _table(header, rows)
    memory = tiers.get("memory", {})
    reads = memory.get("hits", 0) + memory.get("misses", 0)
    hits = sum(t.get("hits", 0) for t in tiers.values())
    lines += [
        "",
        f"chunk reads: {reads}, served from some tier: {hits} ({_percent(hits, reads)})",
        f"lookups: {stats.get('lookups', 0)}, chunks asked {stats.get('lookup_chunks', 0)}, "
        f"leading hits {stats.get('lookup_hit_chunks', 0)} "
        f"({_percent(stats.get('lookup_hit_chunks', 0), stats.get('lookup_chunks', 0))})",
        f"in flight: {human_bytes(server.get('inflight_bytes', 0))} "
        f"of {human_bytes(server.get('max_inflight_bytes', 0))}",
    ]
    prefetch = stats.get("prefetch")
    if prefetch is not None:  # lookups with prefetch: true (docs/protocol.md 5.5)
        lines.append(
            f"prefetch: {prefetch.get('prefetches', 0)} started, {prefetch.get('prefetched_chunks', 0)} chunks "
            f"({human_bytes(prefetch.get('prefetched_bytes', 0))}) promoted into memory, "
            f"{prefetch.get('declined', 0)} declined"
        )
    if "policy" in memory:
        policy = f"memory policy: {memory['policy']}"
        if "head_rule" in memory:  # cache_policy adaptive
            state = "on: first-seen prompts store their first chunk only" if memory["head_rule"] else "off"
            policy += f", head rule {state} ({memory.get('head_rule_switches', 0)} switches)"
        if "recency_order" in memory:  # cache_policy adaptive: LRU's order or lfuda's
            order = "least recently used first" if memory["recency_order"] else "lfuda's"
            policy += f", eviction order {order} ({memory.get('recency_order_switches', 0)} switches)"
        lines.append(policy + f", {memory.get('skipped', 0)} chunks not admitted")
    if "namespace" in stats:
        ns = dict(stats["namespace"])
        lines += ["", f"namespace {ns.pop('name')}: " + ", ".join(f"{k} {v}" for k, v in ns.items())]
    elif stats.get("namespaces"):
        lines += ["", f"namespaces: {len(stats['namespaces'])} (list them with `admin namespaces`)"]
    return "\n".join(lines)


def format_namespaces(namespaces: dict[str, dict[str, Any]]) -> str:
    if not namespaces:
        return "no namespaces"
    columns = list(dict.fromkeys(k for counts in namespaces.values() for k in counts))  # first-seen order
    rows = []
    for name, counts in sorted(namespaces.items()):
        rows.append(
            [name] + [human_bytes(counts[c]) if c.endswith("bytes") and c in counts else counts.get(c) for c in columns]
        )
    return "\n".join(_table(["namespace", *columns], rows))


def _readyz(base: str | None, timeout_s: float) -> tuple[bool | None, str]:
    if base is None:
        return None, "readiness not checked (no --metrics-url or --config, or metrics_port is 0)"
    try:
        with urllib.request.urlopen(f"{base}/readyz", timeout=timeout_s) as r:
            return r.status == 200, f"{base}/readyz {r.status}"
    except urllib.error.HTTPError as err:
        return False, f"{base}/readyz {err.code}"
    except OSError as err:
        return False, f"{base}/readyz unreachable ({err})"


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="PATH", help="the daemon's YAML config (default: $LMCACHE_CONFIG)")
    common.add_argument(
        "--address",
        metavar="ENDPOINT",
        help=f"tcp://HOST:PORT or ipc:///PATH (default: ${ADDRESS_ENV}, else the config's listen)",
    )
    common.add_argument("--metrics-url", metavar="URL", help="base URL of /readyz (default: from the config)")
    common.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="per request (default 5)")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument(
        "--server-public-key",
        metavar="KEY",
        help="auth: curve: the daemon's public key, Z85 or a key file (default: from the config)",
    )
    common.add_argument(
        "--client-secret-key",
        metavar="KEY",
        help="auth: curve: this client's secret key file (mode 0600) or Z85; admin role for global commands",
    )
    p = argparse.ArgumentParser(
        prog="lmcache-server admin",
        description="Talk to a running lmcache-server over its wire protocol.",
        epilog=f"The daemon: --address, else ${ADDRESS_ENV}, else --config's (or $LMCACHE_CONFIG's) first "
        "listen endpoint, else tcp://127.0.0.1:65432. With auth: curve pass --client-secret-key (and "
        "--server-public-key without --config); see docs/security.md. Each command: "
        "lmcache-server admin COMMAND --help.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("ping", parents=[common], help="one round trip; prints the latency")
    sub.add_parser("health", parents=[common], help="ping, version and readiness; exit 1 unless ready")
    stats = sub.add_parser("stats", parents=[common], help="tier and lookup statistics")
    stats.add_argument("--namespace", metavar="NS", help="also show this namespace's counts")
    sub.add_parser("namespaces", parents=[common], help="chunks and bytes per namespace and tier")
    clear = sub.add_parser("clear", parents=[common], help="drop a namespace's chunks (or all, with --all --yes)")
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="NS", help="the namespace string (see docs/protocol.md)")
    which.add_argument("--all", action="store_true", help="every namespace: the whole cache")
    clear.add_argument("--yes", action="store_true", help="confirm --all")
    add_commands(sub, common)
    # Listed here so that --help names it; main() hands its arguments to adminwhohas.py,
    # which talks HTTP to several nodes and takes none of the flags above.
    sub.add_parser("who-has", help="which of several nodes holds the longest prefix of a prompt (HTTP /query)")
    return p


def _run(args: argparse.Namespace, address: str, base: str | None, client: CacheClient) -> int:
    out: dict[str, Any]
    rc = 0
    if args.command == "ping":
        rtt = client.ping()
        out = {"address": address, "ok": True, "rtt_ms": round(rtt * 1000, 3)}
        text = f"pong from {address} in {rtt * 1000:.2f} ms"
    elif args.command == "health":
        rtt = client.ping()
        hello = client.hello("lmcache-server-admin")
        ready, why = _readyz(base, args.timeout)
        ok = ready is not False
        out = {
            "address": address,
            "ok": ok,
            "rtt_ms": round(rtt * 1000, 3),
            "version": hello.get("server_version"),
            "protocol_version": hello.get("protocol_version"),
            "tiers": hello.get("tiers"),
            "ready": ready,
            "readyz": why,
        }
        text = (
            f"{'healthy' if ok else 'NOT READY'}: lmcache-server {out['version']} at {address}, "
            f"ping {rtt * 1000:.2f} ms, tiers {', '.join(out['tiers'] or [])}; {why}"
        )
        rc = 0 if ok else 1
    elif args.command == "stats":
        out = client.stats(namespace=args.namespace)
        text = format_stats(out, address)
    elif args.command == "namespaces":
        out = client.stats().get("namespaces", {})
        text = format_namespaces(out)
    elif args.command != "clear":  # the cache commands
        out, text = run_command(args, client)
    else:
        removed = client.clear(namespace=args.namespace, all_namespaces=args.all)
        target = "every namespace" if args.all else f"namespace {args.namespace}"
        out = {"address": address, "removed": removed, "namespace": None if args.all else args.namespace}
        text = f"removed {removed} chunks from {target}"
    _print(json.dumps(out, indent=2, sort_keys=True) if args.json else text)
    return rc


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaces stdout for the interpreter's exit flush


def _server_public_key(config: ServerConfig) -> str | None:
    """The daemon's public key from its config: the ``.key`` beside the secret file, or the secret file."""
    secret = config.server_secret_key_file
    if secret is None:
        return None
    for candidate in (secret.removesuffix("_secret"), secret):
        try:
            public: bytes = read_public_key(candidate)
            return public.decode()
        except KeyFileError:
            continue
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["who-has"]:
        from .adminwhohas import main as who_has_main

        return who_has_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "clear" and args.all and not args.yes:
        print("refusing: --all drops every chunk of every namespace; add --yes", file=sys.stderr)
        return 2
    # Failures are reported below, once; the client's own outage warning would repeat them.
    logging.getLogger("lmcache_client").setLevel(logging.ERROR)
    try:
        address, source = target_address(args.address, os.environ)
    except UsageError as err:
        print(str(err), file=sys.stderr)
        return 2
    curve_daemon = False
    base: str | None = args.metrics_url.rstrip("/") if args.metrics_url else None
    # With only --address (or the variable) there is no config to guess the HTTP port from.
    if address is None or args.config:
        try:
            # The address variable is read above: the config's "no such key" warning would be noise.
            config = load_config(args.config, environ={k: v for k, v in os.environ.items() if k != ADDRESS_ENV})
        except ConfigError as err:
            print(f"cannot read the daemon's config: {err}", file=sys.stderr)
            return 2
        address = address or daemon_address(config)
        base = base or metrics_url(config)
        curve_daemon = config.auth == "curve"
        if args.client_secret_key and not args.server_public_key:
            args.server_public_key = _server_public_key(config)
    context = zmq.Context()
    try:
        with CacheClient(
            address,
            timeout_s=args.timeout,
            fail_open=False,
            context=context,
            server_public_key=args.server_public_key,
            client_secret_key=args.client_secret_key,
        ) as client:
            return _run(args, address, base, client)
    except KeyFileError as err:
        print(f"cannot use the CURVE keys: {err}", file=sys.stderr)
        return 2
    except PromptError as err:
        print(f"{args.command}: {err}", file=sys.stderr)
        return 2
    except NoNamespace as err:
        print(f"{args.command}: {err}", file=sys.stderr)
        return 1
    except DaemonUnavailable as err:
        hint = (
            " (its config says auth: curve: pass --client-secret-key)"
            if curve_daemon and not args.client_secret_key
            else ""
        )
        print(f"lmcache-server at {address} (from {source}) unavailable: {err}{hint}", file=sys.stderr)
        return 1
    except ClientError as err:
        print(f"lmcache-server at {address} refused: {err}", file=sys.stderr)
        return 1
    finally:
        # destroy, not term: a socket some failure left open must not keep the CLI waiting.
        context.destroy(linger=0)
