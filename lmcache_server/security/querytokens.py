"""Who may ask ``POST /query`` on the metrics port (docs/security.md, "POST /query").

HTTP carries no CURVE identity, and a query answer says which prompts some
tenant has cached (and, by model, every tenant's namespace names), so the
endpoint has an access rule of its own, never implied by ``allow_insecure``:

- with ``query_tokens_file``: every query needs ``Authorization: Bearer
  TOKEN`` with a token from the file, on any ``metrics_host``; a token is
  ``admin`` (every namespace) or limited by grants, the client keys file's
  shape (``{tenant: NAME}`` or ``{prefix: STRING}``, read-only);
- without it: answered only under ``auth: none`` on a loopback
  ``metrics_host`` (whoever reaches it may read every chunk over the loopback
  ZeroMQ endpoint anyway); refused otherwise.

The file is YAML, readable by its owner only (it holds secrets)::

    tokens:
      router:                                   # a name, for logs
        token: "<at least 32 characters>"       # e.g. openssl rand -hex 32
        admin: true
      router-acme:
        token: "..."
        grants: [{tenant: acme}, {prefix: "shared/"}]

Tokens are compared in constant time (SHA-256 digests with
:func:`hmac.compare_digest`, every token every time). A namespace outside a
token's grants is answered exactly as an absent one (:mod:`..server.query`).

Primitives: :class:`QueryScope`, :class:`QueryAccess` (``from_config``, ``scope``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, ServerConfig
from .access import Grant, parse_grant
from .guard import is_loopback_host

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 32
"""A shorter token could be guessed over the network."""
_KEY = "query_tokens_file"


@dataclasses.dataclass(frozen=True)
class QueryScope:
    """What one caller of ``/query`` may see: every namespace (``admin``) or its grants'."""

    name: str
    admin: bool = False
    grants: tuple[Grant, ...] = ()

    def sees(self, namespace: str) -> bool:
        return self.admin or any(g.matches(namespace) for g in self.grants)


class QueryAccess:
    """The ``/query`` access rule of one daemon: open, refused, or bearer tokens."""

    def __init__(self, tokens: list[tuple[bytes, QueryScope]] | None, open_scope: QueryScope | None, refusal: str):
        self._tokens = tokens
        self._open = open_scope
        self.refusal = refusal
        """Why a request is refused (the 401/403 message)."""

    @property
    def needs_token(self) -> bool:
        return self._tokens is not None

    @classmethod
    def from_config(cls, config: ServerConfig) -> QueryAccess:
        """The rule the config gives; ConfigError (exit 2) for a tokens file that is refused."""
        if config.query_tokens_file is not None:
            tokens = _load(config.query_tokens_file)
            logger.info("POST /query: bearer tokens required (%d in %s)", len(tokens), config.query_tokens_file)
            return cls(tokens, None, "POST /query needs Authorization: Bearer TOKEN, a token of query_tokens_file")
        if config.auth == "none" and is_loopback_host(config.metrics_host):
            return cls(None, QueryScope("loopback", admin=True), "")
        why = (
            "auth: curve is on and HTTP carries no client key"
            if config.auth == "curve"
            else f"metrics_host {config.metrics_host} is not loopback"
        )
        if config.metrics_port:
            logger.info("POST /query is off (%s; set query_tokens_file, docs/security.md)", why)
        refusal = (
            f"POST /query is off: {why}; the daemon serves it with query_tokens_file (bearer tokens, docs/security.md)"
        )
        return cls(None, None, refusal)

    def scope(self, authorization: str | None) -> QueryScope | None:
        """The scope an ``Authorization`` header value gives; None: refused (:attr:`refusal`)."""
        if self._tokens is None:
            return self._open
        scheme, _, token = (authorization or "").strip().partition(" ")
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        found: QueryScope | None = None
        for known, scope in self._tokens:  # every token every time: no early exit to time
            if hmac.compare_digest(digest, known):
                found = scope
        return found if scheme.lower() == "bearer" else None


def _refuse(path: str, expected: str) -> ConfigError:
    return ConfigError(_KEY, path, expected)


def _load(path: str) -> list[tuple[bytes, QueryScope]]:
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text()
    except OSError as err:
        raise _refuse(path, f"a readable file ({err.strerror})") from None
    if not stat.S_ISREG(mode) or mode & 0o077:
        raise _refuse(path, f"a file only its owner may access (mode is {stat.S_IMODE(mode):04o}; chmod 600)")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise _refuse(path, f"valid YAML ({err})") from None
    if not isinstance(data, dict) or set(data) != {"tokens"} or not isinstance(data["tokens"], dict):
        raise _refuse(path, "a YAML mapping with one key, tokens: {NAME: {token, admin | grants}}")
    out: list[tuple[bytes, QueryScope]] = []
    for name, entry in data["tokens"].items():
        out.append(_entry(path, name, entry))
    if not out:
        raise _refuse(path, "at least one token")
    if len({digest for digest, _ in out}) != len(out):
        raise _refuse(path, "each token once (two entries share one)")
    return out


def _entry(path: str, name: Any, entry: Any) -> tuple[bytes, QueryScope]:
    if not isinstance(name, str) or not name or not name.isprintable():
        raise _refuse(path, f"token names that are non-empty printable strings, got {name!r}")
    if not isinstance(entry, dict) or set(entry) - {"token", "admin", "grants"}:
        raise _refuse(path, f"token {name!r}: keys token, admin, grants")
    token, admin, grants = entry.get("token"), entry.get("admin", False), entry.get("grants") or []
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or not token.isprintable() or " " in token:
        raise _refuse(path, f"token {name!r}: a token of at least {MIN_TOKEN_CHARS} printable characters, no spaces")
    if not isinstance(admin, bool) or not isinstance(grants, list):
        raise _refuse(path, f"token {name!r}: admin true/false and grants a list")
    if admin == bool(grants):
        raise _refuse(path, f"token {name!r}: either admin: true or a list of grants")
    try:
        parsed = tuple(parse_grant(g, f"token {name!r}", accesses=("ro",)) for g in grants)
    except ValueError as err:
        raise _refuse(path, str(err)) from None
    return hashlib.sha256(token.encode()).digest(), QueryScope(name, admin, parsed)
