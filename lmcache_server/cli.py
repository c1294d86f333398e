"""Command line: ``lmcache-server --config server.yaml [flags]`` (also ``python -m lmcache_server``).

Flags override environment variables, which override the file (see config.py).
Exit codes: 0 after a clean stop, 2 for a refused configuration, 1 otherwise.
``lmcache-server admin COMMAND ...`` runs an admin command against a running
daemon instead (see admin.py); ``lmcache-server keygen NAME`` writes a CURVE
key pair (see security/keygen.py and docs/security.md); ``lmcache-server
cleanup`` removes the memory pools kept for a warm restart (see cleanup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__
from .config import ConfigError, load_config, set_overrides
from .configprint import config_yaml

logger = logging.getLogger("lmcache_server")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-server",
        description="Standalone KV-cache server for LLM inference engines (ZeroMQ).",
        epilog="Every config key can also be set as LMCACHE_<KEY> in the environment "
        "(other LMCACHE_* variables are ignored with one warning). "
        "Precedence: flags > environment > config file > defaults. "
        "Admin commands for a running daemon (each listed there): lmcache-server admin --help. "
        "CURVE key pairs: lmcache-server keygen NAME --help. "
        "Pools kept for a warm restart, after a final stop: lmcache-server cleanup --help",
    )
    p.add_argument(
        "--config", metavar="PATH", help="YAML config file (default: $LMCACHE_CONFIG or $LMCACHE_CONFIG_FILE, or none)"
    )
    p.add_argument(
        "--listen",
        action="append",
        metavar="ENDPOINT",
        help="tcp://HOST:PORT or ipc:///PATH to bind (repeatable; replaces the configured list)",
    )
    p.add_argument("--max-local-cpu-size", metavar="SIZE", help='memory pool size, e.g. 8 (GB) or "8GiB"')
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="HTTP port of /metrics (0 disables)")
    p.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument(
        "--keep-warm",
        action="store_true",
        help="a supervisor restarts this daemon: a clean stop keeps the memory pool for the next start "
        "(warm_restart: true); without it the pool is released at the stop",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any config key (repeatable); VALUE is read as YAML",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config as YAML that --config loads back (secrets redacted) and exit",
    )
    p.add_argument("--version", action="version", version=f"lmcache-server {__version__}")
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = set_overrides(args.set)
    if args.listen:
        out["listen"] = args.listen
    if args.max_local_cpu_size is not None:
        size = args.max_local_cpu_size
        out["max_local_cpu_size"] = float(size) if size.replace(".", "", 1).isdigit() else size
    if args.metrics_port is not None:
        out["metrics_port"] = args.metrics_port
    if args.log_level is not None:
        out["log_level"] = args.log_level
    if args.keep_warm:
        out["warm_restart"] = True
    return out


def _write_stdout(text: str) -> None:
    """Write ``text`` to stdout; a reader that went away (``| head``) is no error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would flush stdout again at exit and print a traceback: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["admin"]:
        from .admin import main as admin_main

        return admin_main(argv[1:])
    if argv[:1] == ["cleanup"]:
        from .cleanup import main as cleanup_main

        return cleanup_main(argv[1:])
    if argv[:1] == ["keygen"]:
        from .security.keygen import main as keygen_main

        return keygen_main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, overrides=_overrides(args))
    except ConfigError as err:
        logger.error("refusing to start: %s", err)
        return 2
    logging.getLogger().setLevel(config.log_level)
    if args.print_config:
        _write_stdout(config_yaml(config))
        return 0

    from .app import App

    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep running without it
        runner = asyncio.run
    try:
        return int(runner(App(config).run()))
    except ConfigError as err:
        logger.error("refusing to start: %s", err)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
