"""A client process that takes what it can and never gives it back (tests/server/test_fair_share.py).

    python tests/server/_greedy_client.py slow-reader ADDRESS NAMESPACE COUNT KEYHEX...
        sends COUNT gets of the keys, 50 ms apart, and never reads a reply:
        libzmq takes in a message or two (the receive high-water mark is 1),
        then a reply stays queued in the daemon; whichever get comes once the
        connection holds nothing is the one that sticks
    python tests/server/_greedy_client.py alloc-hog ADDRESS NAMESPACE CHUNK_BYTES TRIES
        reserves shared-memory room chunk after chunk and never commits

Each prints one line (``sent`` after its first get, or the alloc statuses as
JSON) and then keeps its connection open until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

import msgpack
import zmq

from lmcache_client.protocol import Op, encode_request


def dealer(address: str, rcvbuf: int | None = None) -> zmq.Socket:  # type: ignore[type-arg]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    if rcvbuf is not None:
        sock.setsockopt(zmq.RCVBUF, rcvbuf)
        sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def slow_reader(address: str, namespace: str, count: int, keys: list[bytes]) -> zmq.Socket:  # type: ignore[type-arg]
    sock = dealer(address, rcvbuf=4096)
    for i in range(count):
        sock.send_multipart(encode_request(Op.GET, 1000 + i, namespace, keys))
        if i == 0:
            print("sent", flush=True)
        time.sleep(0.05)
    return sock


def alloc_hog(address: str, namespace: str, chunk_bytes: int, tries: int) -> zmq.Socket:  # type: ignore[type-arg]
    sock = dealer(address)
    sock.send_multipart(encode_request(Op.HELLO, 1, None, None, client="alloc-hog"))
    hello = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    segment = hello["shm"]["segment"]
    outcomes = []
    for i in range(tries):
        sock.send_multipart(
            encode_request(Op.ALLOC, 10 + i, namespace, [os.urandom(32)], sizes=[chunk_bytes], shm=segment)
        )
        reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
        outcomes.append("ok" if reply.get("ok") and reply.get("lease") else reply.get("name") or reply.get("status"))
    print(json.dumps(outcomes), flush=True)
    return sock


if __name__ == "__main__":
    mode, address, namespace = sys.argv[1:4]
    if mode == "slow-reader":
        held = slow_reader(address, namespace, int(sys.argv[4]), [bytes.fromhex(k) for k in sys.argv[5:]])
    else:
        held = alloc_hog(address, namespace, int(sys.argv[4]), int(sys.argv[5]))
    while True:  # keep the connection (and ``held``) open
        time.sleep(60)
