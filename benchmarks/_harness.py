"""Shared plumbing of the benchmarks: child processes, timing, and the raw ZeroMQ echo server.

Primitives:

- :class:`Processes`: starts child processes (daemon, echo server, redis-server)
  in their own sessions with ``PR_SET_PDEATHSIG``, and stops every one of them
  (SIGTERM, then SIGKILL) from a ``finally``, also on Ctrl-C or SIGTERM;
  ``start_piped`` for a worker that answers on its stdout.
- :func:`free_port`, :func:`wait_until`, :func:`start_daemon` (a daemon with
  ``--set`` settings, returned once it answers a ping).
- :func:`measure` / :func:`measure_group`: warm-up calls, then ``reps`` timed
  repetitions of ``calls`` calls each (interleaved across the members of a
  group); a :class:`Stats` of MiB/s (median, min, max) per member.
- :class:`CpuMeter`: how much CPU other processes took meanwhile (noise check);
  :func:`cpu_seconds`: a process's CPU time (servers' CPU seconds per GiB moved);
  :func:`minor_faults`: page faults of a process (receive buffers that glibc
  handed back to the kernel fault in again on every message).
- :func:`write_chunk_files`: N small chunk files written with the disk tier's
  own record writer (what an index rebuild is timed on).
- :func:`redis_client`: redis-py with the hiredis *parser* but the pure-Python
  *serializer* (the hiredis serializer copies every large value into one bytes
  object before sending; the Python one sends memoryviews as they are).
- :func:`echo_server_main`: the raw pyzmq ROUTER baseline, run as
  ``python benchmarks/_harness.py echo-server ENDPOINT...``.  Protocol:

  ``[b"put", payload...]``       -> ``[b"ok"]``              (tiny ack)
  ``[b"get SIZE COUNT"]``        -> ``[b"ok", payload...]``  (COUNT frames of SIZE
                                    bytes from preallocated buffers, sent zero-copy)
  ``[b"hello"]``                 -> ``[b"tuned=0|1"]``       (whether tune_malloc applied)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

MIB = 1024 * 1024
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, alive: Callable[[], None]) -> None:
    """Poll ``predicate`` until true; ``alive`` raises if the process behind it died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready within {timeout_s:.0f}s")


def start_daemon(procs: Processes, name: str, port: int, settings: dict[str, object]) -> Child:
    """Start ``python -m lmcache_server`` on ``tcp://127.0.0.1:port`` (metrics off) with
    ``settings`` as ``--set`` flags; returns once it answers a ping."""
    from lmcache_client import CacheClient, DaemonUnavailable

    argv = [sys.executable, "-m", "lmcache_server", "--listen", f"tcp://127.0.0.1:{port}", "--metrics-port", "0"]
    for k, v in settings.items():
        argv += ["--set", f"{k}={v}"]
    child = procs.start(name, argv)

    def up() -> bool:
        try:
            with CacheClient(f"tcp://127.0.0.1:{port}", "bench|ping", timeout_s=0.3, fail_open=False) as c:
                c.ping(timeout_s=0.3)
            return True
        except DaemonUnavailable:
            return False

    wait_until(up, 60, f"{name} to answer", child.check_alive)
    return child


def _die_with_parent() -> None:  # runs in the child between fork and exec
    name = ctypes.util.find_library("c")
    if name:
        ctypes.CDLL(name).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        rc = self.proc.poll()
        if rc is not None:
            raise RuntimeError(f"{self.name} exited with code {rc}; log tail:\n{self.log_tail()}")


class Processes:
    """Every child process the benchmark starts; :meth:`stop_all` ends them all."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None):
        self.workdir = workdir
        self.env = env
        self.children: list[Child] = []
        self._logs: list[IO[bytes]] = []

    def start(self, name: str, argv: Sequence[str], cwd: Path | None = None) -> Child:
        """A child whose stdout and stderr go to ``<workdir>/<name>.log``."""
        return self._spawn(name, argv, cwd, piped=False)

    def start_piped(self, name: str, argv: Sequence[str], cwd: Path | None = None) -> Child:
        """Like :meth:`start`, but with pipes to the child's stdin and stdout (a worker
        answering requests line by line); only its stderr goes to the log."""
        return self._spawn(name, argv, cwd, piped=True)

    def _spawn(self, name: str, argv: Sequence[str], cwd: Path | None, piped: bool) -> Child:
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed in stop_all
        self._logs.append(log)
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
            stdout=subprocess.PIPE if piped else log,
            stderr=log if piped else subprocess.STDOUT,
            cwd=cwd,
            env=self.env,
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
            preexec_fn=_die_with_parent,  # and they go if we are SIGKILLed
        )
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def stop(self, child: Child, timeout_s: float = 10.0) -> None:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def stop_all(self) -> None:
        for child in reversed(self.children):
            try:
                self.stop(child)
            except Exception as err:  # keep stopping the others
                print(f"warning: could not stop {child.name}: {err}", file=sys.stderr)
        for log in self._logs:
            log.close()


_M_ARENA_MAX = -8


def limit_malloc_arenas(n: int) -> bool:
    """``mallopt(M_ARENA_MAX, n)`` in this process (an experiment; children get MALLOC_ARENA_MAX).

    Takes effect only for threads that have not malloc'ed yet, so call it before
    creating any ZeroMQ context.  With n=1 libzmq's I/O thread allocates its
    receive buffers from the main arena, where tune_malloc's settings keep them.
    """
    name = ctypes.util.find_library("c")
    return bool(name) and bool(ctypes.CDLL(name).mallopt(_M_ARENA_MAX, n))


@contextlib.contextmanager
def workspace(prefix: str, env: dict[str, str] | None = None) -> Iterator[tuple[Processes, Path]]:
    """A temp dir and the child processes of one benchmark run.

    On exit (also on Ctrl-C or SIGTERM, see :func:`raise_on_sigterm`) every
    child is stopped and the directory removed.
    """
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    procs = Processes(workdir, env)
    try:
        yield procs, workdir
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def raise_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks run."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# -- timing --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stats:
    """Throughput of one cell in MiB/s over the timed repetitions, and page faults
    per GiB moved (client process, server process) during them; a buffer that is
    page-faulted in full costs 262,144 faults per GiB (4 KiB pages)."""

    median: float
    low: float
    high: float
    reps: int
    faults_per_gib: tuple[float, float] = (0.0, 0.0)
    cpu_s_per_gib: float | None = None
    """CPU seconds (user + system, all threads) the member's server process spent per
    GiB moved during the timed repetitions; None without a CPU probe."""

    def spread(self) -> str:
        return f"[{self.low:,.0f}..{self.high:,.0f}]"


FaultProbe = Callable[[], tuple[int, int]]
"""Minor page faults so far of (this process, the server process); see :func:`minor_faults`."""
CpuProbe = Callable[[], float]
"""CPU seconds a process has used so far; see :func:`cpu_seconds`."""


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process so far, all its threads (this process if None)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0


def minor_faults(pid: int | None) -> int:
    """Minor page faults of a process so far, all its threads (this process if None)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minflt
    except (OSError, IndexError, ValueError):
        return 0


def measure(call: Callable[[], None], bytes_per_call: int, calls: int, reps: int, warmup: int) -> Stats:
    """``warmup`` untimed calls, then ``reps`` repetitions of ``calls`` timed calls."""
    return measure_group([(call, None)], bytes_per_call, calls, reps, warmup)[0]


def measure_group(
    members: Sequence[tuple[Callable[[], None], FaultProbe | None]],
    bytes_per_call: int,
    calls: int,
    reps: int,
    warmup: int,
    settles: Sequence[Callable[[], None] | None] | None = None,
    cpu_probes: Sequence[CpuProbe | None] | None = None,
) -> list[Stats]:
    """Like :func:`measure` for several systems at once, interleaved: repetition i
    of every member runs before repetition i+1 of any, so a burst of outside load
    lands on all of them alike instead of on whichever happened to be running.
    Each member may come with a fault probe, read around its timed repetitions,
    and a ``settle`` call timed at the end of each of its repetitions: a server
    that finishes work after answering (the daemon copies a put into its pool
    right after the reply) pays for it in its own repetition, not the next
    member's.  A ``cpu_probe`` per member (its server's :func:`cpu_seconds`) gives
    :attr:`Stats.cpu_s_per_gib`."""
    settles = settles or [None] * len(members)
    cpu_probes = cpu_probes or [None] * len(members)
    for call, _ in members:
        for _ in range(warmup):
            call()
    rates: list[list[float]] = [[] for _ in members]
    faults = [[0, 0] for _ in members]
    cpu = [0.0 for _ in members]
    for _ in range(reps):
        for i, ((call, probe), settle, out, fault) in enumerate(zip(members, settles, rates, faults)):
            before = probe() if probe else (0, 0)
            cpu_probe = cpu_probes[i]
            cpu_before = cpu_probe() if cpu_probe else 0.0
            start = time.perf_counter()
            for _ in range(calls):
                call()
            if settle is not None:
                settle()
            out.append(bytes_per_call * calls / MIB / (time.perf_counter() - start))
            if cpu_probe:
                cpu[i] += cpu_probe() - cpu_before
            after = probe() if probe else (0, 0)
            fault[0] += after[0] - before[0]
            fault[1] += after[1] - before[1]
    gib = bytes_per_call * calls * reps / 1024**3
    return [
        Stats(statistics.median(r), min(r), max(r), reps, (f[0] / gib, f[1] / gib), c / gib if probe else None)
        for r, f, c, probe in zip(rates, faults, cpu, cpu_probes)
    ]


class CpuMeter:
    """CPU time the whole host spent busy, and how much of it our processes used.

    The rest is outside load (other jobs on the machine), which makes figures noisy.
    """

    def __init__(self, pids: Callable[[], Sequence[int]]):
        self._pids = pids
        self._tick = os.sysconf("SC_CLK_TCK")
        self._t0 = time.monotonic()
        self._host0 = self._host_busy()
        self._ours0 = self._ours()

    @staticmethod
    def _host_busy() -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return float(sum(fields[:8]) - idle)

    def _ours(self) -> float:
        """This process, its children that exited and were reaped (``os.times``' children
        fields: a finished child's CPU time moves there), and each live child with the
        children it reaped: no child's time counts as outside load once it exits."""
        t = os.times()
        total = (t.user + t.system + t.children_user + t.children_system) * self._tick
        for pid in self._pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
            except (OSError, IndexError, ValueError):
                pass
        return total

    def outside_load(self) -> float:
        """Cores' worth of CPU used by processes other than ours since construction."""
        elapsed = time.monotonic() - self._t0
        other = (self._host_busy() - self._host0) - (self._ours() - self._ours0)
        return max(0.0, other / self._tick / elapsed) if elapsed > 0 else 0.0


def descendants(pids: Sequence[int]) -> list[int]:
    """``pids`` and every process below them (vLLM's engine core and workers, say)."""
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between the nearest ranks (NaN for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def announce_load() -> None:
    """Print the load average a benchmark starts on (busy: its figures will be noisy)."""
    load = load_average()
    print(f"load average before start: {load:.2f}" + ("  (busy machine: expect noisy figures)" if load > 0.5 else ""))


def filled_buffer(size: int, seed: int) -> bytearray:
    """``size`` bytes of a non-zero pattern, every page written (no shared zero pages)."""
    block = bytes((seed * 131 + i * 7 + 1) % 251 + 1 for i in range(4096))
    out = bytearray(size)
    view = memoryview(out)
    for offset in range(0, size, 4096):
        n = min(4096, size - offset)
        view[offset : offset + n] = block[:n]
    return out


def write_chunk_files(directory: Path, entries: int, namespace: str, payload_bytes: int = 4096, start: int = 0) -> None:
    """Write chunk files ``start``..``entries - 1`` under ``directory`` (a disk tier's
    root) with the daemon's own record writer, keys ``(namespace, i as 32
    little-endian bytes)``."""
    from lmcache_server.storage.base import ChunkKey
    from lmcache_server.storage.disk.files import path_for, write_record

    payload = os.urandom(payload_bytes)
    for i in range(start, entries):
        key = ChunkKey(namespace, i.to_bytes(32, "little"))
        write_record(path_for(directory, key), key, payload, "none")
        if i and i % 100000 == 0:
            print(f"  wrote {i} files", flush=True)


# -- redis-py -----------------------------------------------------------------------------
def redis_client(port: int) -> Any:
    """redis-py client: hiredis parser, pure-Python serializer (large values not copied)."""
    import redis
    from redis._parsers import Encoder, _HiredisParser
    from redis.connection import PythonRespSerializer

    # The Python serializer is stateless; 6000 is redis-py's own buffer cutoff.
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)  # type: ignore[no-untyped-call]
    pool = redis.ConnectionPool(
        host="127.0.0.1",
        port=port,
        parser_class=_HiredisParser,
        command_packer=packer,
        socket_timeout=60,
        protocol=2,
    )
    client = redis.Redis(connection_pool=pool)
    conn = pool.get_connection()
    try:
        assert isinstance(conn._parser, _HiredisParser), type(conn._parser)
        assert isinstance(conn._command_packer, PythonRespSerializer), type(conn._command_packer)
    finally:
        pool.release(conn)
    return client


# -- the raw ZeroMQ echo server -----------------------------------------------------------
def echo_server_main(endpoints: Sequence[str]) -> int:
    """Blocking ROUTER loop; SIGTERM ends it."""
    import zmq

    from lmcache_client.memtune import tune_malloc

    tuned = tune_malloc()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    # The daemon's ROUTER options that matter for throughput.
    sock.setsockopt(zmq.RCVHWM, 256)
    sock.setsockopt(zmq.SNDHWM, 256)
    sock.setsockopt(zmq.LINGER, 0)
    for endpoint in endpoints:
        sock.bind(endpoint)
    print(f"echo server on {' '.join(endpoints)}; malloc tuned: {tuned}", flush=True)
    payloads: list[memoryview] = []
    payload_key: tuple[int, int] = (0, 0)
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            ident, header = frames[0], frames[1].bytes
            if header == b"put":
                sock.send_multipart([ident, b"ok"])
            elif header.startswith(b"get "):
                size, count = (int(x) for x in header.split()[1:3])
                if payload_key != (size, count):  # preallocate once per shape, outside the hot path
                    payloads = [memoryview(filled_buffer(size, i)) for i in range(count)]
                    payload_key = (size, count)
                sock.send_multipart([ident, b"ok", *payloads], copy=False)
            elif header == b"hello":
                sock.send_multipart([ident, b"tuned=%d" % tuned])
            else:
                sock.send_multipart([ident, b"error"])
            # Free the received buffers now, as the daemon does once it has replied,
            # not only when the next recv rebinds the name (that would hold two
            # requests' worth of buffers and change how glibc reuses them).
            del frames, ident
    finally:
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "echo-server":
        sys.exit(echo_server_main(sys.argv[2:]))
    print(f"usage: {os.path.basename(sys.argv[0])} echo-server ENDPOINT...", file=sys.stderr)
    sys.exit(2)
