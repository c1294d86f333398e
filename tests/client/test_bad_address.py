"""A daemon address that is no ZeroMQ endpoint is one clear error, at once, and leaves
nothing open: before, pyzmq's bare ZMQError escaped from the constructor and the socket it
left behind kept the process from exiting (the admin CLI hung on such an address)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from lmcache_client import AsyncCacheClient, BadAddress, CacheClient, ClientError

BAD = ["localhost:65432", "udp://127.0.0.1:1", "tcp://"]


@pytest.mark.parametrize("address", BAD)
def test_the_sync_client_names_the_address(address: str) -> None:
    with pytest.raises(BadAddress, match=r"tcp://HOST:PORT or ipc:///PATH") as raised:
        CacheClient(address, timeout_s=0.5, fail_open=False).ping()
    assert repr(address) in str(raised.value)
    assert isinstance(raised.value, ClientError) and isinstance(raised.value, ValueError)


def test_the_asyncio_client_names_the_address() -> None:
    async def run() -> None:
        client = AsyncCacheClient("localhost:65432", timeout_s=0.5, fail_open=False)
        try:
            await client.ping()
        finally:
            await client.close()

    with pytest.raises(BadAddress, match="localhost:65432"):
        asyncio.run(run())


def test_a_process_that_met_a_bad_address_exits() -> None:
    """Nothing is left open: the interpreter's exit does not wait on a socket."""
    code = (
        "from lmcache_client import BadAddress, CacheClient\n"
        "try:\n    CacheClient('localhost:65432', timeout_s=0.5).ping()\n"
        "except BadAddress as err:\n    print('refused:', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("refused: "), out.stderr
