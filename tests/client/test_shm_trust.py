"""The client's shared-memory path trusts no daemon (issue 29, item 2).

A "daemon" here may be anyone who bound the port (under ``auth: none``) or a
daemon with a bug.  What it says about shared memory must not make the client
write outside the daemon's own pool segment: a fake ROUTER daemon (a real zmq
socket in a thread) offers files that are not pool segments, and locations
outside the segment or the payload; the client's file stays byte for byte and
the put goes over payload frames or fails cleanly.  (A zstd bomb in a codec
frame, item 4: test_codec.py.)
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from lmcache_client import CacheClient, PutStatus
from lmcache_client.protocol import Op
from lmcache_client.protocol.messages import Limits, decode_request, encode_reply

from ..conftest import NAMESPACE, SHM_ROOT, wait_for

PAYLOAD = 512 * 1024  # above shm.PUT_MIN_BYTES: a put over shared memory when the pool is mapped
SEGMENT = 4 << 20
KEY = bytes(range(32))

Answer = Callable[[Any], dict[str, Any]]


class FakeDaemon:
    """A ROUTER socket that answers like a daemon offering ``offer`` in hello.

    ``answers`` overrides the reply fields per op (a function of the request);
    every request's op is recorded in ``ops``, and the payloads of frame puts
    in ``framed``."""

    def __init__(self, offer: dict[str, Any] | None, answers: dict[Op, Answer] | None = None, hold: bool = True):
        self.offer = offer
        self._held: int | None = None
        if hold and offer is not None and Path(offer["path"]).is_file():
            # A daemon holds an exclusive flock on its segment while it runs (storage/memory/pool.py).
            self._held = os.open(offer["path"], os.O_RDONLY)
            try:
                fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # an earlier fake daemon of the test holds it
        self.answers = answers or {}
        self.ops: list[Op] = []
        self.framed: list[bytes] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, *frames = self._sock.recv_multipart()
            request = decode_request(frames, Limits())
            self.ops.append(request.op)
            if request.op is Op.PUT:
                self.framed += [bytes(p) for p in request.payloads]
            fields = self._answer(request)
            self._sock.send_multipart([ident, *encode_reply(request.id, **fields)])

    def _answer(self, request: Any) -> dict[str, Any]:
        if request.op in self.answers:
            return self.answers[request.op](request)
        n = len(request.keys)
        if request.op is Op.HELLO:
            return {"shm": self.offer} if self.offer is not None else {}
        if request.op is Op.ALLOC:
            sizes = request.fields["sizes"]
            loc = [[sum(sizes[:i]), s] for i, s in enumerate(sizes)]
            return {"status": [0] * n, "loc": loc, "lease": 11, "expires": time.monotonic() + 30}
        if request.op in (Op.PUT, Op.COMMIT):
            return {"status": [0] * max(n, 1)}
        if request.op is Op.GET:
            return {"found": [False] * n, "loc": [None] * n}
        if request.op is Op.RELEASE:
            return {"released": [True] * len(request.fields["leases"])}
        return {}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()
        if self._held is not None:
            os.close(self._held)


@pytest.fixture
def fake_daemon() -> Iterator[Callable[..., FakeDaemon]]:
    made: list[FakeDaemon] = []

    def make(offer: dict[str, Any] | None, answers: dict[Op, Answer] | None = None, hold: bool = True) -> FakeDaemon:
        made.append(FakeDaemon(offer, answers, hold))
        return made[-1]

    yield make
    for d in made:
        d.close()


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if SHM_ROOT is None:
        pytest.skip("no /dev/shm")
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="lmcache-test-h2-", dir=SHM_ROOT))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def offer_for(path: Path, token: str, size: int | None = None) -> dict[str, Any]:
    return {
        "path": str(path),
        "size": path.stat().st_size if size is None else size,
        "segment": token,
        "lease_timeout_s": 30.0,
        "clock": time.monotonic(),
    }


def victim(path: Path, size: int = SEGMENT) -> bytes:
    """A file of recognisable bytes that no put must change."""
    data = (b"weights!" * (size // 8 + 1))[:size]
    path.write_bytes(data)
    return data


def put_one(address: str) -> list[Any]:
    with CacheClient(address, NAMESPACE, timeout_s=5, fail_open=False, staged_puts=False) as c:
        return c.put([KEY], [b"\x01" * PAYLOAD])


def segment_name(token: str) -> str:
    return f"lmcache-pool-{os.getpid()}-{token}"


# -- item 2: what the client maps -------------------------------------------------------
def test_a_real_looking_segment_is_mapped(fake_daemon: Callable[..., FakeDaemon], shm_dir: Path) -> None:
    """The control: a pool segment as the daemon makes one is mapped and written."""
    token = secrets.token_hex(16)
    path = shm_dir / segment_name(token)
    before = victim(path)
    d = fake_daemon(offer_for(path, token))
    assert put_one(d.address) == [PutStatus.STORED]
    assert Op.ALLOC in d.ops and Op.COMMIT in d.ops and not d.framed
    assert path.read_bytes()[:PAYLOAD] == b"\x01" * PAYLOAD != before[:PAYLOAD]


def _offers(tmp_path: Path, shm_dir: Path) -> Iterator[tuple[str, Path, dict[str, Any]]]:
    """(what is wrong, the file no put may change, the offer naming it)."""
    token = secrets.token_hex(16)
    weights = tmp_path / "model.safetensors"
    victim(weights)
    yield "any file", weights, offer_for(weights, token)

    on_disk = tmp_path / segment_name(token)  # the right name, not on tmpfs
    victim(on_disk)
    yield "not on tmpfs", on_disk, offer_for(on_disk, token)

    link = shm_dir / segment_name(token)  # the right name on tmpfs, a symlink to the weights
    link.symlink_to(weights)
    yield "symlink", weights, offer_for(link, token)
    link.unlink()

    other = shm_dir / segment_name(secrets.token_hex(16))  # another token than announced
    victim(other)
    yield "another token", other, offer_for(other, token)

    plain = shm_dir / "engine-scratch"  # tmpfs, but not a pool segment's name
    victim(plain)
    yield "not a segment name", plain, offer_for(plain, token)

    sized = shm_dir / segment_name(token)
    victim(sized)
    yield "another size", sized, offer_for(sized, token, size=SEGMENT // 2)
    sized.unlink()

    linked = shm_dir / "scratch-two"  # a second name for a tmpfs file: not the daemon's own segment
    victim(linked)
    os.link(linked, shm_dir / segment_name(token))
    yield "hard link", linked, offer_for(shm_dir / segment_name(token), token)
    (shm_dir / segment_name(token)).unlink()

    fifo = shm_dir / segment_name(token)
    os.mkfifo(fifo)
    yield "fifo", fifo, {**offer_for(fifo, token), "size": SEGMENT}
    fifo.unlink()


def test_files_that_are_not_pool_segments_are_never_written(
    fake_daemon: Callable[..., FakeDaemon], shm_dir: Path, tmp_path: Path
) -> None:
    """A hello naming any file but a pool segment (right name and token, a regular
    file alone on tmpfs, of the announced size): the put goes over frames and the
    file is unchanged byte for byte."""
    checked = []
    for what, path, offer in _offers(tmp_path, shm_dir):
        before = path.read_bytes() if path.is_file() else b""
        d = fake_daemon(offer)
        assert put_one(d.address) == [PutStatus.STORED], what
        assert Op.ALLOC not in d.ops and d.framed == [b"\x01" * PAYLOAD], what
        assert (path.read_bytes() if path.is_file() else b"") == before, what
        checked.append(what)
    assert len(checked) == 8


def test_a_segment_no_running_daemon_holds_is_never_written(
    fake_daemon: Callable[..., FakeDaemon], shm_dir: Path
) -> None:
    """A real pool segment, but no daemon holds its lock (one kept for a warm
    restart: the next daemon adopts its bytes): whoever answers hello meanwhile
    cannot have clients write into it."""
    token = secrets.token_hex(16)
    path = shm_dir / segment_name(token)
    before = victim(path)
    d = fake_daemon(offer_for(path, token), hold=False)
    assert put_one(d.address) == [PutStatus.STORED]
    assert Op.ALLOC not in d.ops and d.framed == [b"\x01" * PAYLOAD]
    assert path.read_bytes() == before


def test_a_refused_segment_is_logged_once(
    fake_daemon: Callable[..., FakeDaemon], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weights = tmp_path / "model.safetensors"
    victim(weights)
    d = fake_daemon(offer_for(weights, secrets.token_hex(16)))
    with caplog.at_level("INFO", logger="lmcache_client"):
        for _ in range(3):
            put_one(d.address)
    refusals = [r for r in caplog.records if "not a pool segment" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelname == "WARNING"


# -- item 2: locations the daemon gives -------------------------------------------------------
def _alloc_at(loc: list[Any]) -> Answer:
    return lambda req: {"status": [0], "loc": [loc], "lease": 11, "expires": time.monotonic() + 30}


@pytest.mark.parametrize(
    "loc",
    [
        [SEGMENT - PAYLOAD // 2, PAYLOAD],  # runs past the segment's end
        [SEGMENT - 100, PAYLOAD // 2],  # past the end, and shorter than the payload
        [0, PAYLOAD // 2],  # inside, but shorter than the payload: would spill into the next slot
        [-4096, PAYLOAD],  # before the start
        [0, PAYLOAD, 7],  # not an (offset, length)
        ["0", PAYLOAD],
    ],
)
def test_a_put_into_a_bad_location_writes_nothing(
    fake_daemon: Callable[..., FakeDaemon], shm_dir: Path, loc: list[Any]
) -> None:
    token = secrets.token_hex(16)
    path = shm_dir / segment_name(token)
    before = victim(path)
    d = fake_daemon(offer_for(path, token), {Op.ALLOC: _alloc_at(loc)})
    with CacheClient(d.address, NAMESPACE, timeout_s=5, fail_open=False, staged_puts=False) as c:
        assert c.put([KEY], [b"\x01" * PAYLOAD]) == [PutStatus.FAILED]
        wait_for(lambda: Op.RELEASE in d.ops, 5)  # the grant is let go (a release sent without waiting)
    assert Op.COMMIT not in d.ops
    assert path.read_bytes() == before


def test_overlapping_locations_write_nothing(fake_daemon: Callable[..., FakeDaemon], shm_dir: Path) -> None:
    token = secrets.token_hex(16)
    path = shm_dir / segment_name(token)
    before = victim(path)
    grant = {"status": [0, 0], "loc": [[0, PAYLOAD], [PAYLOAD // 2, PAYLOAD]], "lease": 11}
    d = fake_daemon(offer_for(path, token), {Op.ALLOC: lambda req: {**grant, "expires": time.monotonic() + 30}})
    with CacheClient(d.address, NAMESPACE, timeout_s=5, fail_open=False, staged_puts=False) as c:
        assert c.put([KEY, KEY[::-1]], [b"\x01" * PAYLOAD, b"\x02" * PAYLOAD]) == [PutStatus.FAILED] * 2
    assert Op.COMMIT not in d.ops
    assert path.read_bytes() == before


def test_staged_slots_outside_the_segment_are_never_used(fake_daemon: Callable[..., FakeDaemon], shm_dir: Path) -> None:
    """Slots a commit stages for the next put are checked like alloc's: one outside
    the segment is not written (nor handed to ``fill``); the put takes alloc+commit."""
    token = secrets.token_hex(16)
    path = shm_dir / segment_name(token)
    victim(path)

    def commit(req: Any) -> dict[str, Any]:
        reply: dict[str, Any] = {"status": [0]}
        if "stage" in req.fields:
            slots = [[SEGMENT - 100, PAYLOAD]]  # the right length, past the segment's end
            reply["staged"] = {"lease": 21, "slots": slots, "expires": time.monotonic() + 30}
        return reply

    d = fake_daemon(offer_for(path, token), {Op.COMMIT: commit})
    views: list[int] = []

    def fill(i: int, view: memoryview) -> None:
        views.append(view.nbytes)
        view[:] = b"\x03" * PAYLOAD

    with CacheClient(d.address, NAMESPACE, timeout_s=5, fail_open=False) as c:
        assert c.put([KEY], [b"\x01" * PAYLOAD]) == [PutStatus.STORED]
        assert c.put([KEY[::-1]], [b"\x02" * PAYLOAD]) == [PutStatus.STORED]  # streaming: asks for staged slots
        assert Op.COMMIT in d.ops and c._pool is not None and c._pool.staged is not None
        assert c.put_with([bytes(32)], [PAYLOAD], fill) == [PutStatus.STORED]
        assert c.put([bytes(31) + b"\x01"], [b"\x04" * PAYLOAD]) == [PutStatus.STORED]
    assert views == [PAYLOAD]
    assert Op.BIND not in d.ops and d.ops.count(Op.ALLOC) == 4


@pytest.mark.parametrize("loc", [[SEGMENT - 100, 4096], [-4096, 4096], [0, 4096, 1]])
def test_a_hit_at_a_bad_location_is_a_miss(
    fake_daemon: Callable[..., FakeDaemon], shm_dir: Path, loc: list[Any]
) -> None:
    """get, get_into and get_with: a hit placed outside the segment is a miss
    (no bytes from elsewhere, no exception), and its lease is released."""
    token = secrets.token_hex(16)
    path = shm_dir / segment_name(token)
    victim(path)
    grant = {"found": [True], "loc": [loc], "lease": 12}
    d = fake_daemon(offer_for(path, token), {Op.GET: lambda req: {**grant, "expires": time.monotonic() + 30}})
    used: list[bytes] = []
    with CacheClient(d.address, NAMESPACE, timeout_s=5, fail_open=False) as c:
        assert c.uses_shared_memory
        assert c.get([KEY]) == [None]
        assert c.get_into([KEY], [bytearray(4096)]) == [False]
        assert c.get_with([KEY], lambda i, view: used.append(bytes(view))) == [False]
        wait_for(lambda: d.ops.count(Op.RELEASE) == 3, 5)  # each read lease is let go
    assert used == []
