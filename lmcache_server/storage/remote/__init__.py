"""The Redis tier: a write-behind uplink shared by every node of a deployment.

- ``tier``: :class:`RedisTier`, its lifecycle, reads and removals;
- ``writer``: the write-behind (the records built off the loop, the pipelines);
- ``carryover``: what a clean stop owed Redis, taken over by the next start;
- ``link``: the connection to Redis or a Redis Cluster, retries, counters;
- ``queue``: the bounded queue of writes owed to Redis;
- ``pending``: removals and writes owed to Redis, saved across a clean stop
  (in the file :func:`state_path_for` names).

It imports the storage leaves only, never the memory or disk tier.
Code outside this room imports the names below from ``storage.remote``.
"""

from .tier import RedisTier, state_path_for

__all__ = ["RedisTier", "state_path_for"]
