"""Tests of the daemon (lmcache_server.server, security, events, metrics): wire, admission, lifecycle."""
