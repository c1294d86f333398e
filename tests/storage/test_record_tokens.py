"""Token ids in the records below memory (storage/chunkfile.py, format 2): what a disk
file or a Redis value carries so that a node finding it later can announce it.

- a record with token ids reads back with them, and one without is byte for byte
  format 1 (what older daemons write and read);
- a damaged token section, token ids that do not hash to the record's key, a count
  past the bound, a truncated header: each is a CorruptRecord (a miss), never ids
  announced for the wrong key;
- the disk tier's files: a header longer than one block (a long chunk's ids) is
  written buffered and read back, by a read and by the start's scan.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from lmcache_client.keys import ROOT_KEY, ChunkTokens, chain_key, pack_tokens
from lmcache_server.storage.base import ChunkKey
from lmcache_server.storage.chunkfile import (
    FORMAT_VERSION,
    TOKENS_VERSION,
    CorruptRecord,
    checksum,
    decode_record,
    encode_header,
    encode_record,
    parse_header,
)
from lmcache_server.storage.disk.files import HEADER_BLOCK, path_for, read_record, scan, write_record

NS = "model|bfloat16|L1|KV1|D64|tp0of1|c256"


def tokens_of(ids: list[int], parent: bytes = ROOT_KEY) -> tuple[bytes, ChunkTokens]:
    return chain_key(parent, ids), ChunkTokens(parent, pack_tokens(ids))


def test_a_record_carries_its_token_ids_and_one_without_is_format_1() -> None:
    payload = os.urandom(4096)
    key, tokens = tokens_of(list(range(256)))
    record = encode_record(NS, key, payload, tokens)
    assert struct.unpack_from("<H", record, 4)[0] == TOKENS_VERSION
    got, read = decode_record(bytes(record), NS, key)
    assert bytes(got) == payload and read == tokens
    plain = encode_record(NS, key, payload)
    assert struct.unpack_from("<H", plain, 4)[0] == FORMAT_VERSION
    assert struct.unpack_from("<I", plain, 60)[0] == 0  # the reserved field of format 1
    got, read = decode_record(bytes(plain), NS, key)
    assert bytes(got) == payload and read is None


def test_damaged_or_foreign_token_ids_are_a_corrupt_record() -> None:
    payload = os.urandom(100)
    key, tokens = tokens_of(list(range(1000, 1256)))
    header = bytearray(encode_header(NS, key, payload, tokens=tokens))
    ids_at = 64 + len(NS.encode()) + 32
    flipped = bytearray(header)
    flipped[ids_at + 5] ^= 1
    with pytest.raises(CorruptRecord, match="header checksum"):
        parse_header(flipped)
    # Ids that do not hash to the key, with a header checksum made to match: still refused.
    other_key, _ = tokens_of(list(range(256)))
    foreign = encode_header(NS, other_key, payload, tokens=tokens)
    with pytest.raises(CorruptRecord, match="do not hash to its key"):
        parse_header(foreign)
    # A count past the bound, or past the bytes given.
    big = bytearray(header)
    struct.pack_into("<I", big, 60, (1 << 20) + 1)
    with pytest.raises(CorruptRecord, match="token ids"):
        parse_header(big)
    with pytest.raises(CorruptRecord, match="truncated"):
        parse_header(header[: ids_at + 100])
    # The count is covered by the checksum: a smaller one (inside the bytes) is caught.
    fewer = bytearray(header)
    struct.pack_into("<I", fewer, 60, 255)
    with pytest.raises(CorruptRecord, match="checksum"):
        parse_header(fewer)
    assert parse_header(header).tokens == tokens
    assert checksum(payload) == parse_header(header).payload_crc


def test_disk_files_keep_long_token_ids_past_one_block_and_the_scan_reads_them(tmp_path: Path) -> None:
    short_key, short = tokens_of(list(range(256)))
    long_key, long = tokens_of(list(range(2000)), parent=short_key)  # 8,000 bytes of ids: a 2-block header
    plain_key = os.urandom(32)
    payloads = {short_key: os.urandom(5000), long_key: os.urandom(HEADER_BLOCK), plain_key: os.urandom(10)}
    told = {short_key: short, long_key: long, plain_key: None}
    for digest, payload in payloads.items():
        key = ChunkKey(NS, digest)
        written = write_record(path_for(tmp_path, key), key, payload, "none", direct=False, tokens=told[digest])
        assert os.path.getsize(path_for(tmp_path, key)) == written
        assert bytes(read_record(path_for(tmp_path, key), key)) == payload
    assert os.path.getsize(path_for(tmp_path, ChunkKey(NS, long_key))) == 2 * HEADER_BLOCK + HEADER_BLOCK
    found, removed = scan(tmp_path, tokens=True)
    assert removed == 0
    assert {e[1].digest: e[5] for e in found} == told
    assert {e[1].digest: e[3] for e in found} == {d: len(p) for d, p in payloads.items()}
    assert all(e[5] is None for e in scan(tmp_path)[0])  # not asked for: not kept
    # A file whose long header was cut short is damaged: removed by the scan, never read.
    path = path_for(tmp_path, ChunkKey(NS, long_key))
    with open(path, "r+b") as f:
        f.truncate(HEADER_BLOCK + 100)
    with pytest.raises(CorruptRecord):
        read_record(path, ChunkKey(NS, long_key))
    found, removed = scan(tmp_path, tokens=True)
    assert removed == 1 and long_key not in {e[1].digest for e in found}


def test_the_chunk_size_a_namespace_names() -> None:
    """What the announcer compares a record's token count with (issue 39 item 9)."""
    from lmcache_client.namespace import Namespace, chunk_size_of

    assert chunk_size_of(NS) == 256
    assert chunk_size_of(Namespace("m", "bf16", 2, 1, 64, 16, tenant="c9").wire()) == 16
    assert chunk_size_of("c16|bfloat16") is None  # the model id is never read as one
    assert chunk_size_of("opaque") is None and chunk_size_of("m|c|cx|c٣") is None
