"""Tests of lmcache_server.events: the KV-event stream, replay, snapshots, records' token ids, the query endpoint."""
