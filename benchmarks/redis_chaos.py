"""Redis kill and freeze rounds under load: how many puts answered STORED never reach Redis.

Starts a redis-server whose AOF is written before each reply (in a tmpfs
directory, so it is fast and a SIGKILL loses nothing it acknowledged) and a
daemon with it as its uplink, then streams puts from a client thread
(``fail_open=False``: every put is answered or the run fails) while, round
after round, Redis is either SIGKILLed and restarted on the same port and
directory (``kill``) or frozen with SIGSTOP for ``--freeze-s`` seconds, longer
than the daemon's ``remote_timeout_s``, and resumed (``freeze``).  After the
last round the load stops, the write-behind queue drains, and every key
answered STORED is looked up in Redis.  Writes are dropped (and counted) only
when the write-behind queue overflows (``--queue-mib``); ``silent`` is what was
lost without being counted, and must be 0 even then.

    .venv/bin/python benchmarks/redis_chaos.py --rounds 10 --json chaos.json

Prints and (``--json``) writes {"rounds", "kills", "freezes", "stored",
"lost", "dropped_writes", "reconnects", "seconds"}; exits 1 if any put was lost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import redis  # noqa: E402
from _harness import Processes, free_port, raise_on_sigterm, wait_until  # noqa: E402

from lmcache_client import CacheClient, DaemonUnavailable, PutStatus  # noqa: E402

NAMESPACE = "chaos-model|float16|L2|KV2|D64|tp0of1|c16"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def redis_key(key: bytes, prefix: str = "lmcache:") -> bytes:
    return f"{prefix}{hashlib.sha256(NAMESPACE.encode()).hexdigest()[:16]}:{key.hex()}".encode()


class Load(threading.Thread):
    def __init__(self, address: str, payload_bytes: int):
        super().__init__(daemon=True)
        self.address = address
        self.payload = os.urandom(payload_bytes)
        self.stored: list[bytes] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with CacheClient(self.address, NAMESPACE, timeout_s=10, fail_open=False, shared_memory=False) as c:
                while not self.stop.is_set():
                    key = os.urandom(32)
                    if c.put([key], [self.payload]) == [PutStatus.STORED]:
                        self.stored.append(key)
        except BaseException as err:  # reported by main
            self.error = err


def uplink(c: CacheClient) -> dict[str, Any]:
    return dict(c.stats()["tiers"]["redis"])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="rounds, alternating kill and freeze (default 10)")
    p.add_argument("--freeze-s", type=float, default=2.0, help="how long Redis stays frozen (default 2)")
    p.add_argument("--payload-kib", type=int, default=32, help="bytes per put (default 32 KiB)")
    p.add_argument(
        "--queue-mib",
        type=int,
        default=1024,
        help="the daemon's max_remote_queue_size: room for the writes of an outage (default 1024)",
    )
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    raise_on_sigterm()
    base = Path(tempfile.mkdtemp(prefix="lmcache-chaos-"))
    aof_dir = Path(tempfile.mkdtemp(prefix="lmcache-chaos-redis-", dir=SHM))
    procs = Processes(base)
    started = time.monotonic()
    try:
        port = free_port()
        argv_redis = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                      "--appendfsync", "always", "--dir", str(aof_dir)]  # fmt: skip

        def start_redis() -> Any:
            child = procs.start("redis", argv_redis)
            wait_until(lambda: _answers(port), 30, "redis-server", child.check_alive)
            return child

        server = start_redis()
        address = f"tcp://127.0.0.1:{free_port()}"
        daemon = procs.start("daemon", [
            sys.executable, "-m", "lmcache_server", "--listen", address, "--metrics-port", "0",
            "--max-local-cpu-size", "256MiB", "--set", f"remote_url=redis://127.0.0.1:{port}",
            "--set", "remote_timeout_s=0.5", "--set", "stats_log_interval_s=0",
            "--set", f"max_remote_queue_size={args.queue_mib}MiB",
        ])  # fmt: skip
        with CacheClient(address, NAMESPACE, timeout_s=10, fail_open=False, shared_memory=False) as c:
            wait_until(lambda: _pingable(c), 30, "daemon", daemon.check_alive)
            load = Load(address, args.payload_kib * 1024)
            load.start()
            kills = freezes = 0

            def more(n: int) -> None:
                target = len(load.stored) + n
                wait_until(lambda: len(load.stored) >= target or load.error is not None, 60, "puts", daemon.check_alive)

            more(200)
            for round_no in range(args.rounds):
                if round_no % 2 == 0:
                    server.proc.kill()
                    server.proc.wait(10)
                    more(100)  # puts go on while Redis is gone
                    server = start_redis()
                    kills += 1
                else:
                    server.proc.send_signal(signal.SIGSTOP)
                    time.sleep(args.freeze_s)  # longer than remote_timeout_s: the uplink goes down
                    server.proc.send_signal(signal.SIGCONT)
                    freezes += 1
                wait_until(lambda: bool(uplink(c)["up"]), 60, "uplink back", daemon.check_alive)
                more(200)
            load.stop.set()
            load.join(30)
            if load.error is not None:
                raise load.error
            wait_until(lambda: uplink(c)["queued_writes"] == 0 and uplink(c).get("pending_removals", 0) == 0,
                       120, "write-behind queue drained", daemon.check_alive)  # fmt: skip
            stats = uplink(c)
        r = redis.Redis(port=port)
        lost = sum(1 for key in load.stored if not r.exists(redis_key(key)))
        result = {
            "rounds": args.rounds, "kills": kills, "freezes": freezes, "stored": len(load.stored), "lost": lost,
            "dropped_writes": stats["dropped_writes"], "silent": lost - stats["dropped_writes"],
            "reconnects": stats["reconnects"],
            "seconds": round(time.monotonic() - started, 1),
        }  # fmt: skip
        print(json.dumps(result))
        print("PASS: every put answered STORED reached Redis" if lost == 0 else f"MISS: {lost} puts lost")
        if args.json:
            Path(args.json).write_text(json.dumps(result))
        return 0 if lost == 0 else 1
    finally:
        procs.stop_all()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(aof_dir, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _pingable(c: CacheClient) -> bool:
    try:
        c.ping(timeout_s=0.5)
        return True
    except DaemonUnavailable:
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
