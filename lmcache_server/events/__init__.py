"""KV events for KV-aware routers (docs/events.md).

The daemon announces, in vLLM's KV-event wire format, which token blocks this
node can serve: ``BlockStored`` when a put with token ids becomes readable
(and again with its new medium when it moves between memory and disk),
``BlockRemoved`` when the chunk leaves the last local tier, ``AllBlocksCleared``
on a clear and at each start (a new epoch).

Modules, one job each: :mod:`.blocks` (event block hashes, the per-topic and
per-medium reference counts, the token ids kept per chunk), :mod:`.wire` (the
msgpack encoding), :mod:`.replay` (the bounded replay buffer),
:mod:`.publisher` (PUB + replay ROUTER sockets, batching, sequence numbers,
heartbeats, the epoch's publisher id), :mod:`.announcer` (what the tiered
store tells us -> events per topic and medium; the room's front, which builds
and holds the publisher, the snapshot endpoint and the Redis watch),
:mod:`.snapshot` (the snapshot endpoint), :mod:`.remote` (what this node's Redis
uplink holds) and :mod:`.keep` (what a clean stop keeps for the next start).
"""

from .announcer import Announcer, EventSettings
from .publisher import EventPublisher, PublisherSettings
from .remote import RemoteSettings
from .snapshot import SnapshotSettings

__all__ = ["Announcer", "EventPublisher", "EventSettings", "PublisherSettings", "RemoteSettings", "SnapshotSettings"]
