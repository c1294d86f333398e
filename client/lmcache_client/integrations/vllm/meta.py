"""What the vLLM connector's scheduler side tells its workers, once per engine step.

vLLM pickles the metadata from the scheduler process to every worker, so it
is plain data: token ranges, chunk keys and block ids.

Primitives: :class:`LoadRequest`, :class:`SaveRequest` and
:class:`LMCacheServerConnectorMetadata` (the object vLLM carries).
"""

from __future__ import annotations

import dataclasses

from ...keys import ChunkTokens
from .compat import KVConnectorMetadata
from .states import StateSave


@dataclasses.dataclass
class LoadRequest:
    """Fill tokens ``[start_token, end_token)`` of a request from the daemon.

    ``keys[i]`` is the key of full chunk ``first_chunk + i``; with ``tail_key``
    the prompt's partial last chunk (``tail_tokens`` tokens, right after the
    full chunks) follows them.  Together they cover the range.  Tokens before
    ``start_token`` are vLLM's own prefix-cache hits and are never written.
    """

    req_id: str
    keys: list[bytes]
    first_chunk: int
    start_token: int
    end_token: int
    block_ids: list[int]
    """The request's blocks, from its first token on."""
    tail_key: bytes | None = None
    tail_tokens: int = 0
    group_block_ids: list[list[int]] | None = None
    """Several KV cache groups (:mod:`.groups`): each group's blocks (``block_ids`` is the
    first's); a sliding-window group's null blocks are never written."""
    state_tokens: int = 0
    """A Mamba hybrid (:mod:`.states`): the load ends with the state after this many
    tokens (``end_token``), under ``state_key`` into ``state_blocks`` (one per Mamba
    group); a load whose state is missing or mismatched fails as a whole."""
    state_key: bytes | None = None
    state_blocks: list[int] | None = None


@dataclasses.dataclass
class SaveRequest:
    """Store full chunks ``first_chunk .. first_chunk + len(keys) - 1`` of a request
    (and with ``tail_key`` its partial last chunk of ``tail_tokens`` tokens, which
    starts at token ``tail_start``), computed in this step or earlier and still in
    its blocks."""

    req_id: str
    keys: list[bytes]
    first_chunk: int
    block_ids: list[int]
    tail_key: bytes | None = None
    tail_start: int = 0
    tail_tokens: int = 0
    tokens: list[ChunkTokens] | None = None
    """Each full chunk's parent key and token ids, for a daemon that publishes KV
    events (None for requests whose keys start from a salted root)."""
    group_block_ids: list[list[int]] | None = None
    """Several KV cache groups: each group's blocks (``block_ids`` is the first's)."""


@dataclasses.dataclass
class LMCacheServerConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadRequest] = dataclasses.field(default_factory=list)
    saves: list[SaveRequest] = dataclasses.field(default_factory=list)
    delayed: list[str] = dataclasses.field(default_factory=list)
    """Requests whose blocks the scheduler holds until the workers report their
    asynchronous saves done (``finished_sending``)."""
    preempted: list[str] = dataclasses.field(default_factory=list)
    """Requests preempted in this step: their blocks are handed out again, so the
    saves reading them must finish before the forward pass."""
    idle: bool = False
    """The step computes nothing (a worker may wait a little for a load to finish)."""
    load_deadlines: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per-request load deadlines in seconds (``kv_transfer_params``), overriding the setting."""
    state_saves: list[StateSave] = dataclasses.field(default_factory=list)
    """Mamba states vLLM handed off in this step (:mod:`.states`), copied out at ``wait_for_save``."""
