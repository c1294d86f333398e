"""Tests of lmcache_server.security: CURVE authentication, tenant grants, key files, who may query."""
