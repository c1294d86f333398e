"""KV events for KV-aware routers (docs/events.md).

The daemon announces, in vLLM's KV-event wire format, which token blocks this
node can serve: ``BlockStored`` when a put with token ids becomes readable,
``BlockRemoved`` when the chunk leaves the last local tier, ``AllBlocksCleared``
on a clear.

Modules, one job each: :mod:`.blocks` (event block hashes and the per-topic
reference counts), :mod:`.wire` (the msgpack encoding), :mod:`.replay` (the
bounded replay buffer), :mod:`.publisher` (PUB + replay ROUTER sockets,
batching, sequence numbers) and :mod:`.announcer` (what the tiered store
tells us -> events per topic).
"""

from .announcer import Announcer, EventSettings
from .publisher import EventPublisher

__all__ = ["Announcer", "EventPublisher", "EventSettings"]
