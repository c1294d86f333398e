"""The disk tier: chunks spilled from memory to files in a spill directory.

- ``tier``: :class:`DiskTier`, its spill, write and read paths;
- ``lifecycle``: opening (the directory's lock, the index rebuilt from the
  snapshot or a scan) and closing;
- ``index``: the index of chunks on disk, its byte counts, eviction, removal;
- ``files``: one chunk file each (CRC32C-checked records, O_DIRECT when it can);
- ``snapshot``: the index saved at a clean stop for a fast restart;
- ``spillqueue``: the bounded queue of writes waiting for the disk.

It imports the storage leaves and :mod:`..policy`, never the memory or Redis tier.
Code outside this room imports :class:`DiskTier` from ``storage.disk``.
"""

from .tier import DiskTier

__all__ = ["DiskTier"]
