"""The remote tier: a store shared by every node (Redis, or Mooncake Store), written
behind and read through.

- ``tier``: :class:`RemoteTier`, its lifecycle, reads and removals;
- ``links``: what the tier needs of its store (:class:`.links.RemoteLink`);
- ``link``: the connection to Redis or a Redis Cluster, retries, counters;
- ``mooncake``: the connection to a Mooncake Store cluster (:class:`MooncakeSettings`);
- ``writer``: the write-behind (the records built off the loop, the batches);
- ``carryover``: what a clean stop owed the store, taken over by the next start;
- ``queue``: the bounded queue of writes owed to the store;
- ``pending``: removals and writes owed to the store, saved across a clean stop
  (in the file :func:`state_path_for` names).

It imports the storage leaves only, never the memory or disk tier.
Code outside this room imports the names below from ``storage.remote``.
"""

from .link import RedisLink
from .links import LinkFactory
from .mooncake import MooncakeLink, MooncakeSettings
from .tier import RemoteTier, state_path_for

__all__ = ["LinkFactory", "MooncakeLink", "MooncakeSettings", "RedisLink", "RemoteTier", "state_path_for"]
