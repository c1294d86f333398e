"""Who may do what: clients (by CURVE public key), their tenant grants and roles.

The client keys file (``client_keys_file``) is YAML::

    clients:
      vllm-acme:                       # the client's name: logs, metrics, ZAP User-Id
        public_key: "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"   # Z85, or a .key file path
        grants:
          - {tenant: acme, access: rw}          # namespaces ending in |tenant=acme
          - {prefix: "shared/", access: ro}     # namespaces starting with shared/
      ops:
        public_key: keys/ops.key                # relative to this file's folder
        admin: true                             # every namespace, clear all, global stats

A grant matches a namespace either by its tenant field (the last ``|``
field is exactly ``tenant=<name>``, as ``Namespace(tenant=...).wire()``
writes it) or by a string prefix.  ``ro`` allows get, lookup, exists,
prefetch (as a lookup with ``prefetch: true``) and the namespace's stats
(its listing); ``rw`` also put, delete, pin, unpin, alloc and bind
(shared-memory puts) and clear of the namespace.  hello, ping and the lease ops
commit and release are open to every key.  Ops with no rule here (including
any added later) need admin.

Primitives: :class:`Grant`, :class:`Principal`, :class:`AccessPolicy`
(``check``), :func:`load_client_keys`, :func:`parse_grant` (the grant shape,
shared with ``query_tokens_file``: :mod:`.querytokens`).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from lmcache_client.curve import KeyFileError, is_z85_key, read_public_key
from lmcache_client.protocol import Op, Request

from ..config import ConfigError

_READ_OPS = {Op.GET, Op.LOOKUP, Op.EXISTS, Op.PREFETCH}
_WRITE_OPS = {Op.PUT, Op.DELETE, Op.PIN, Op.UNPIN, Op.ALLOC, Op.BIND}
# commit and release name a lease (a random 63-bit id) the client was granted
# by an alloc or get that passed this check; they carry no namespace.
_OPEN_OPS = {Op.HELLO, Op.PING, Op.COMMIT, Op.RELEASE}


@dataclasses.dataclass(frozen=True)
class Grant:
    """Access to the namespaces of one tenant, or to those under one prefix."""

    tenant: str | None
    prefix: str | None
    write: bool

    def matches(self, namespace: str) -> bool:
        if self.tenant is not None:
            return namespace.rpartition("|")[2] == f"tenant={self.tenant}"
        assert self.prefix is not None
        return namespace.startswith(self.prefix)


@dataclasses.dataclass(frozen=True)
class Principal:
    """One client key: its name, role and grants."""

    name: str
    public_key: bytes
    admin: bool = False
    grants: tuple[Grant, ...] = ()

    def may(self, namespace: str, write: bool) -> bool:
        if self.admin:
            return True
        return any(g.matches(namespace) and (g.write or not write) for g in self.grants)


class AccessPolicy:
    """The principals by public key and by name; answers "may this client do this?"."""

    def __init__(self, principals: list[Principal]):
        self.by_key = {p.public_key: p for p in principals}
        self.by_name = {p.name: p for p in principals}

    def check(self, user_id: str | None, request: Request) -> str | None:
        """None if allowed, else why not (the FORBIDDEN message).

        Depends only on the key's grants and the request's op and namespace,
        never on what is stored, so a refused probe learns nothing and costs
        the same whether the chunks exist or not.
        """
        principal = self.by_name.get(user_id or "")
        if principal is None:  # cannot happen behind ZAP; refuse rather than assume
            return "unauthenticated connection"
        op, ns = request.op, request.namespace
        if op in _OPEN_OPS or principal.admin:
            return None
        if ns is not None and op in _READ_OPS | {Op.STATS}:
            write = False
        elif ns is not None and op in _WRITE_OPS | {Op.CLEAR}:
            write = True
        else:
            what = f"run {op.value} without a namespace" if op in (Op.CLEAR, Op.STATS) else f"run {op.value}"
            return f"client {principal.name!r} may not {what}: it needs the admin role"
        if principal.may(ns, write):
            return None
        return f"client {principal.name!r} may not {'write' if write else 'read'} namespace {ns!r}"


def namespace_view(stats: dict[str, Any]) -> dict[str, Any]:
    """What a non-admin client sees of a ``stats`` reply: its namespace's own
    counts, and nothing daemon-wide (other tenants' activity, their quotas)."""
    server = stats.get("server", {})
    return {
        "namespace": stats["namespace"],
        "server": {k: server[k] for k in ("version", "chunk_size") if k in server},
        "scope": "namespace",
    }


def _refuse(path: str, expected: str) -> ConfigError:
    return ConfigError("client_keys_file", path, expected)


def parse_grant(raw: Any, who: str, accesses: tuple[str, ...] = ("ro", "rw")) -> Grant:
    """One grant ``{tenant: NAME | prefix: STRING, access: ...}``; ValueError says what is wrong
    (``who`` names the entry holding it, e.g. ``client 'vllm-acme'``)."""
    where = f"{who}: each grant is {{tenant: NAME | prefix: STRING, access: {' | '.join(accesses)}}}"
    if not isinstance(raw, dict) or set(raw) - {"tenant", "prefix", "access"}:
        raise ValueError(where)
    tenant, prefix, access = raw.get("tenant"), raw.get("prefix"), raw.get("access", "ro")
    if (tenant is None) == (prefix is None) or access not in accesses:
        raise ValueError(where)
    if tenant is not None and (not isinstance(tenant, str) or not tenant or "|" in tenant):
        raise ValueError(f"{who}: a tenant is a non-empty string without '|'")
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise ValueError(f"{who}: a prefix is a non-empty string")
    return Grant(tenant, prefix, access == "rw")


def _grant(path: str, name: str, raw: Any) -> Grant:
    try:
        return parse_grant(raw, f"client {name!r}")
    except ValueError as err:
        raise _refuse(path, str(err)) from None


def load_client_keys(path: str) -> AccessPolicy:
    """Read and validate the client keys file; ConfigError naming what is wrong."""
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text()
    except OSError as err:
        raise _refuse(path, f"a readable file ({err.strerror})") from None
    # Public keys are not secret, but whoever may edit this file may add a key.
    if mode & 0o022:
        raise _refuse(path, f"a file only its owner may write (mode is {stat.S_IMODE(mode):04o}; chmod go-w)")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise _refuse(path, f"valid YAML ({err})") from None
    if not isinstance(data, dict) or set(data) != {"clients"} or not isinstance(data["clients"], dict):
        raise _refuse(path, "a YAML mapping with one key, clients: {NAME: {public_key, grants, admin}}")
    base = Path(path).resolve().parent
    principals: list[Principal] = []
    seen: dict[bytes, str] = {}
    for name, entry in data["clients"].items():
        if not isinstance(name, str) or not name or not name.isprintable():
            raise _refuse(path, f"client names that are non-empty printable strings, got {name!r}")
        if not isinstance(entry, dict) or set(entry) - {"public_key", "grants", "admin"}:
            raise _refuse(path, f"client {name!r}: keys public_key, grants, admin")
        raw_key = entry.get("public_key")
        if not isinstance(raw_key, str):
            raise _refuse(path, f"client {name!r}: public_key, a Z85 key or a key file path")
        key_ref = raw_key if is_z85_key(raw_key) or os.path.isabs(raw_key) else str(base / raw_key)
        try:
            key = read_public_key(key_ref)
        except KeyFileError as err:
            raise _refuse(path, f"client {name!r}: a valid public_key ({err})") from None
        if key in seen:
            raise _refuse(path, f"one name per key; {name!r} and {seen[key]!r} share one")
        seen[key] = name
        admin = entry.get("admin", False)
        grants = entry.get("grants") or []
        if not isinstance(admin, bool) or not isinstance(grants, list):
            raise _refuse(path, f"client {name!r}: admin true/false and grants a list")
        principals.append(Principal(name, key, admin, tuple(_grant(path, name, g) for g in grants)))
    if not principals:
        raise _refuse(path, "at least one client")
    return AccessPolicy(principals)
