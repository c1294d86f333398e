"""Tests of lmcache_server.metrics: /metrics, the summary log line, Prometheus scraping, the sizing telemetry."""
