"""The ``kv_codec`` and ``kv_codec_params`` config keys: which KV codec clients use.

The daemon never encodes or decodes a chunk (it stores opaque, checksummed
bytes); it only validates the codec setting at start and announces it in
``hello``, where every engine adapter reads it and encodes what it stores.
``remote_serde`` keeps LMCache's meaning (what the engine-side client stores):
``cachegen`` stands for ``kv_codec: cachegen`` with its default parameters,
``naive`` for "no lossy codec unless ``kv_codec`` says otherwise".

Validation uses :class:`lmcache_client.codec.spec.CodecSpec`, which needs no
torch, so a daemon installed without torch (``make setup``) checks the setting too.

Primitives: :data:`CODEC_MODES`, :func:`parse_codec`, :func:`parse_codec_params`,
:func:`resolve_codec`, :class:`CodecSettingError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CODEC_MODES = ("none", "lossless", "int8", "cachegen")
"""The codec modes a client may be told to use."""

CodecParams = tuple[tuple[str, Any], ...]


def parse_codec(value: Any) -> str:
    """``kv_codec``: a mode (``int8``) or a spec string with parameters (``int8:group=64``)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError
    mode = value.strip().partition(":")[0].strip().lower()
    if mode not in CODEC_MODES:
        raise ValueError
    return value.strip()


def parse_codec_params(value: Any) -> CodecParams:
    """``kv_codec_params``: a map of parameter name to a number, string or boolean."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError
    out = []
    for name, item in value.items():
        if not isinstance(name, str) or not name or not isinstance(item, (bool, int, float, str)):
            raise ValueError
        out.append((name, item))
    return tuple(sorted(out))


class CodecSettingError(ValueError):
    """A refused codec setting: ``key`` names the config key, ``expected`` what it needs."""

    def __init__(self, key: str, expected: str):
        super().__init__(expected)
        self.key = key
        self.expected = expected


def resolve_codec(kv_codec: str | None, params: CodecParams, remote_serde: str) -> Any:
    """The effective :class:`~lmcache_client.codec.CodecSpec`, ``None`` for raw chunks.

    Raises :class:`CodecSettingError` for an unknown parameter or value, for
    ``kv_codec_params`` without ``kv_codec``, and for a ``kv_codec`` that
    contradicts ``remote_serde: cachegen``."""
    from lmcache_client.codec.spec import CodecSpec  # no torch: the daemon is installed without it

    if kv_codec is None:
        if params:
            raise CodecSettingError("kv_codec_params", "unset unless kv_codec is set")
        kv_codec = "cachegen" if remote_serde == "cachegen" else "none"
    if params and ":" in kv_codec:
        raise CodecSettingError("kv_codec_params", "unset when kv_codec gives parameters ('mode:name=value')")
    key = "kv_codec_params" if params else "kv_codec"
    try:
        spec = CodecSpec.parse(kv_codec)
        if params:
            spec = CodecSpec.from_dict({"mode": spec.mode, "params": dict(params)})
    except (ValueError, TypeError) as err:  # CodecError is a ValueError
        raise CodecSettingError(key, f"a valid codec setting: {err}") from None
    if remote_serde == "cachegen" and spec.mode != "cachegen":
        raise CodecSettingError("kv_codec", f"cachegen or unset when remote_serde is cachegen, not {spec.mode}")
    return None if spec.mode == "none" else spec
