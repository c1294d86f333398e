"""CURVE keys: reading, writing and applying them to a client socket.

A key is given either as its 40-character Z85 text or as the path of a key
file.  Key files use ZeroMQ's certificate format (what ``lmcache-server
keygen`` and pyzmq's ``zmq.auth.create_certificates`` write): a public file
``NAME.key`` with ``public-key = "..."`` and a secret file ``NAME.key_secret``
with both keys.  A file holding only the bare Z85 text is accepted too.
Secret key files must not be readable or writable by group or others
(like ssh keys); a file that is gets refused.

Primitives: :class:`CurveKeys` (``from_options``, ``apply``),
:func:`read_public_key`, :func:`read_secret_key`, :func:`write_keypair`,
:func:`check_private_file`, :func:`is_z85_key`; :class:`KeyFileError`.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

Z85_KEY_CHARS = 40
"""A 32-byte CURVE key in Z85 text."""


class KeyFileError(ValueError):
    """A key or key file was refused: names the file (or option) and why."""


def is_z85_key(text: str) -> bool:
    if len(text) != Z85_KEY_CHARS:
        return False
    try:
        return len(z85.decode(text.encode("ascii"))) == 32
    except (ValueError, UnicodeEncodeError, KeyError):
        return False


def _cert_fields(path: Path) -> dict[str, str]:
    """``public-key`` / ``secret-key`` of a certificate file, or ``key`` for a bare Z85 file."""
    try:
        text = path.read_text()
    except OSError as err:
        raise KeyFileError(f"key file {path}: cannot read it ({err.strerror})") from None
    bare = text.strip()
    if is_z85_key(bare):
        return {"key": bare}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() in ("public-key", "secret-key"):
            fields[name.strip()] = value.strip().strip('"')
    for name, value in fields.items():
        if not is_z85_key(value):
            raise KeyFileError(f"key file {path}: {name} is not a 40-character Z85 CURVE key")
    if not fields:
        raise KeyFileError(f"key file {path}: no public-key or secret-key (and not a bare Z85 key)")
    return fields


def check_private_file(path: str | os.PathLike[str]) -> None:
    """Refuse a secret key file that group or others may read or write."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise KeyFileError(f"secret key file {path}: {err.strerror}") from None
    if not stat.S_ISREG(mode):
        raise KeyFileError(f"secret key file {path}: not a regular file")
    if mode & 0o077:
        raise KeyFileError(
            f"secret key file {path} has mode {stat.S_IMODE(mode):04o}: group or others may access it; "
            f"run `chmod 600 {path}`"
        )


def read_public_key(value: str) -> bytes:
    """A public key (Z85 bytes) from its Z85 text or a key file (public or secret)."""
    if is_z85_key(value):
        return value.encode("ascii")
    fields = _cert_fields(Path(value))
    key = fields.get("public-key") or fields.get("key")
    if key is None:
        raise KeyFileError(f"key file {value}: no public-key")
    return key.encode("ascii")


def read_secret_key(value: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 bytes from a secret key's Z85 text or a secret key file."""
    if is_z85_key(value):
        secret = value.encode("ascii")
        return zmq.curve_public(secret), secret
    check_private_file(value)
    fields = _cert_fields(Path(value))
    secret_text = fields.get("secret-key") or fields.get("key")
    if secret_text is None:
        raise KeyFileError(f"key file {value}: no secret-key (is it the public .key file?)")
    secret = secret_text.encode("ascii")
    public = zmq.curve_public(secret)
    if "public-key" in fields and fields["public-key"].encode("ascii") != public:
        raise KeyFileError(f"key file {value}: public-key does not belong to secret-key")
    return public, secret


def _cert_text(kind: str, public: bytes, secret: bytes | None) -> str:
    lines = [
        f"#   ZeroMQ CURVE {kind} certificate (written by lmcache-server keygen)",
        "#   Format: ZeroMQ ZPL, readable by zmq.auth.load_certificate.",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def write_keypair(directory: str | os.PathLike[str], name: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """A new key pair: ``DIR/NAME.key`` (public, 0644) and ``DIR/NAME.key_secret`` (0600).

    The secret file is created with mode 0600 from the start (never briefly
    readable by others).  Returns ``(public_path, secret_path)``.
    """
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"key name {name!r}: expected a plain file name")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    if not overwrite:
        for path in (public_path, secret_path):
            if path.exists():
                raise KeyFileError(f"{path} exists; pass --force to replace it")
    public, secret = zmq.curve_keypair()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(secret_path, flags, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to an existing file
    with os.fdopen(fd, "w") as f:
        f.write(_cert_text("secret", public, secret))
    fd = os.open(public_path, flags, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(_cert_text("public", public, None))
    return public_path, secret_path


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """What a client needs to authenticate to a daemon with ``auth: curve``."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes = dataclasses.field(repr=False)

    @classmethod
    def from_options(cls, server_public_key: str | None, client_secret_key: str | None) -> CurveKeys | None:
        """From the client options (Z85 text or key file paths); None when neither is set."""
        if not server_public_key and not client_secret_key:
            return None
        if not server_public_key or not client_secret_key:
            raise KeyFileError("CURVE needs both server_public_key and client_secret_key")
        public, secret = read_secret_key(client_secret_key)
        return cls(read_public_key(server_public_key), public, secret)

    def apply(self, sock: Any) -> None:
        """Make ``sock`` (before connect) a CURVE client of the server key."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
