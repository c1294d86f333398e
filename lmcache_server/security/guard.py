"""The daemon's security settings at start and while serving.

At start (:meth:`Security.from_config`): refuse a non-loopback tcp endpoint
without authentication unless ``allow_insecure`` (then warn loudly); with
``auth: curve`` read the daemon's secret key (refused if group or others may
read it) and the client keys file.  Every refusal is a ConfigError (exit 2).

While serving: a ZAP handler (pyzmq's asyncio authenticator, on the daemon's
event loop) accepts a CURVE handshake only from a key in the client keys file
and tags the connection with the client's name, which libzmq hands back on
every received frame as its ``User-Id`` property; :meth:`Security.check`
turns that name and a request into None (allowed) or a FORBIDDEN message.

The server socket sets a ZAP domain and ``ZMQ_ZAP_ENFORCE_DOMAIN``: should
the handler be missing, libzmq refuses handshakes instead of accepting them.

Primitives: :class:`Security` (``from_config``, ``start``,
``configure_socket``, ``check``, ``stop``), :func:`is_loopback_endpoint`,
:func:`is_loopback_host`.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from lmcache_client.curve import KeyFileError, read_secret_key
from lmcache_client.protocol import Request

from ..config import ConfigError, ServerConfig
from ..metrics import ServerMetrics
from .access import AccessPolicy, load_client_keys

logger = logging.getLogger(__name__)

ZAP_DOMAIN = b"lmcache"
_MAX_LOGGED_KEYS = 1000
"""Refused keys are logged once each, up to this many (a scan cannot flood the log)."""


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ``ipc://`` and for tcp endpoints on a loopback address (or ``localhost``)."""
    if endpoint.startswith("ipc://"):
        return True
    return is_loopback_host(endpoint.removeprefix("tcp://").rpartition(":")[0])


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``[::1]`` too)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a wildcard, a host name or an interface name: assume reachable
        return False


def _check_events_exposure(config: ServerConfig) -> None:
    """The events sockets have no authentication and their events carry token ids
    (prompt text): a non-loopback one needs allow_insecure, whatever ``auth`` is."""
    for key in ("events_endpoint", "events_replay_endpoint", "events_snapshot_endpoint"):
        endpoint = getattr(config, key)
        if endpoint is None or is_loopback_endpoint(endpoint):
            continue
        if not config.allow_insecure:
            raise ConfigError(
                key,
                endpoint,
                "a loopback or ipc:// endpoint: KV events carry every prompt's token ids and their sockets "
                "are not authenticated. Set allow_insecure: true on a private network you trust (docs/events.md)",
            )
        logger.warning(
            "INSECURE: %s publishes KV events (token ids of every prompt) to anyone who reaches it (docs/events.md)",
            endpoint,
        )


def _check_exposure(config: ServerConfig) -> None:
    _check_events_exposure(config)
    exposed = [e for e in config.listen if not is_loopback_endpoint(e)]
    if not exposed or config.auth != "none":
        return
    if not config.allow_insecure:
        raise ConfigError(
            "listen",
            exposed[0],
            "a loopback or ipc:// endpoint while auth is none: anyone who reaches it could read, "
            "overwrite and clear every chunk. Set auth: curve (docs/security.md), or allow_insecure: true "
            "on a private network you trust",
        )
    for endpoint in exposed:
        logger.warning(
            "INSECURE: %s accepts unauthenticated, unencrypted clients from the network "
            "(auth: none, allow_insecure: true); anyone who reaches it can read, overwrite and clear "
            "every chunk. Use auth: curve unless this network is private (docs/security.md)",
            endpoint,
        )


class _Authenticator(AsyncioAuthenticator):
    """ZAP handler: a key is accepted only if listed; its User-Id is the client's name.
    ``policy`` answers the policy in force (the owner's, which a SIGHUP replaces)."""

    def __init__(self, context: zmq.asyncio.Context, policy: Callable[[], AccessPolicy], metrics: ServerMetrics | None):
        super().__init__(context, log=logging.getLogger(__name__ + ".zap"))
        self._policy = policy
        self.metrics = metrics
        self._logged: set[bytes] = set()
        self.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=self)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if z85_key in self._policy().by_key:
            return True
        if self.metrics is not None:
            self.metrics.auth_rejections.inc()
        if len(self._logged) < _MAX_LOGGED_KEYS and z85_key not in self._logged:
            self._logged.add(z85_key)
            logger.warning("refused a CURVE handshake from unknown client key %s", z85_key.decode())
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._policy().by_key[z85.encode(client_public_key)].name


class Security:
    def __init__(self, config: ServerConfig, policy: AccessPolicy | None, server_keys: tuple[bytes, bytes] | None):
        self.config = config
        self.policy = policy
        self._server_keys = server_keys
        self._auth: _Authenticator | None = None

    @classmethod
    def from_config(cls, config: ServerConfig) -> Security:
        """Check the endpoints and read the key files; ConfigError (exit 2) on any refusal."""
        _check_exposure(config)
        if config.auth == "none":
            return cls(config, None, None)
        assert config.server_secret_key_file is not None and config.client_keys_file is not None
        try:
            server_keys = read_secret_key(config.server_secret_key_file)
        except KeyFileError as err:
            raise ConfigError("server_secret_key_file", config.server_secret_key_file, str(err)) from None
        policy = load_client_keys(config.client_keys_file)
        admins = sorted(p.name for p in policy.by_name.values() if p.admin)
        logger.info(
            "auth: curve, server public key %s, %d client keys (admin: %s)",
            server_keys[0].decode(),
            len(policy.by_name),
            ", ".join(admins) or "none",
        )
        for p in policy.by_name.values():
            if not p.admin and not p.grants:
                logger.warning("client %r has no grants: it may only ping and hello", p.name)
        return cls(config, policy, server_keys)

    @property
    def enabled(self) -> bool:
        return self.policy is not None

    def _current_policy(self) -> AccessPolicy:
        """The policy in force, as the ZAP handler asks it at each handshake."""
        assert self.policy is not None  # the handler exists only under auth: curve
        return self.policy

    def start(self, context: zmq.asyncio.Context, metrics: ServerMetrics | None = None) -> None:
        """Start the ZAP handler (on the running loop) before any socket binds."""
        if self.policy is not None:
            self._auth = _Authenticator(context, self._current_policy, metrics)
            self._auth.start()

    def configure_socket(self, sock: Any) -> None:
        """Make the server socket (before bind) a CURVE server that requires ZAP."""
        if self._server_keys is None:
            return
        public, secret = self._server_keys
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def reload(self, metrics: ServerMetrics | None = None) -> bool:
        """Read ``client_keys_file`` again (SIGHUP); True if the new keys and grants are in force.

        New keys are accepted at their next handshake; grants apply from the
        next request, on connections already open too; a client left out of
        the file is refused on its open connections (FORBIDDEN) and at its next
        handshake.  A file that is refused changes nothing: the old keys stay."""
        if self.policy is None or self.config.client_keys_file is None:
            logger.info("SIGHUP: auth is off; nothing to reload")
            return False
        try:
            policy = load_client_keys(self.config.client_keys_file)
        except ConfigError as err:
            logger.error("SIGHUP: client keys not reloaded, the previous ones stay in force: %s", err)
            if metrics is not None:
                metrics.key_reloads.labels("error").inc()
            return False
        added = sorted(set(policy.by_name) - set(self.policy.by_name))
        removed = sorted(set(self.policy.by_name) - set(policy.by_name))
        self.policy = policy  # the ZAP handler reads it from here (_current_policy)
        logger.info(
            "SIGHUP: reloaded %s: %d client keys (added: %s; removed: %s)",
            self.config.client_keys_file,
            len(policy.by_name),
            ", ".join(added) or "none",
            ", ".join(removed) or "none",
        )
        if metrics is not None:
            metrics.key_reloads.labels("ok").inc()
        return True

    def sees_everything(self, user_id: str | None) -> bool:
        """Whether the client may see daemon-wide figures (no auth, or an admin key)."""
        if self.policy is None:
            return True
        principal = self.policy.by_name.get(user_id or "")
        return principal is not None and principal.admin

    def check(self, user_id: str | None, request: Request) -> str | None:
        """None if the request is allowed (always, without auth), else the FORBIDDEN message."""
        if self.policy is None:
            return None
        return self.policy.check(user_id, request)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
