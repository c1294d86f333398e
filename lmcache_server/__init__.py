"""lmcache-server: a standalone asyncio KV-cache server daemon for LLM inference."""

__version__ = "0.1.0"
