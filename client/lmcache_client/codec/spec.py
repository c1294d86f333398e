"""Codec settings: which codec a namespace's chunks are encoded with.

A :class:`CodecSpec` is a mode plus its parameters with every default filled
in, so two spellings of one setting (``"int8"`` and ``"int8:group=32"``) are
equal, parse to the same :attr:`CodecSpec.tag` and share chunks.  The tag
goes into the namespace (``codec=<tag>``); it names the mode, the parameters
that change what a frame decodes to, and the frame format version, so raw
chunks, two codec settings and two format versions never mix.

Primitives: :class:`CodecSpec` (``parse``, ``from_dict``, ``to_dict``,
``tag``, ``lossy``) and :data:`MODES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

FORMAT_VERSION = 1
"""Version byte of the encoded frame; part of every tag."""


@dataclasses.dataclass(frozen=True)
class _Param:
    default: Any
    check: Callable[[Any], bool]
    expected: str
    in_tag: str = ""
    """Tag letter for this parameter; "" when it does not change the decoded bytes."""


def _int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _one_of(*choices: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v in choices


MODES: dict[str, dict[str, _Param]] = {
    "none": {},
    "lossless": {
        "level": _Param(1, _int_in(1, 19), "an integer zstd level 1..19"),
    },
    "int8": {
        "group": _Param(32, _one_of(8, 16, 32, 64, 128, 256), "one of 8, 16, 32, 64, 128, 256", "g"),
        "bits": _Param(8, _one_of(2, 4, 8), "one of 2, 4, 8", "b"),
    },
    "cachegen": {
        "bits": _Param(4, _one_of(2, 3, 4, 5, 6), "one of 2, 3, 4, 5, 6 (average bits per element)", "b"),
        "anchor": _Param(16, _one_of(4, 8, 16, 32, 64), "one of 4, 8, 16, 32, 64 (tokens per anchor group)", "a"),
    },
}
"""Every mode and its parameters (default, validity check, description)."""

_MODE_IDS = {"none": 0, "lossless": 1, "int8": 2, "cachegen": 3}


def _coerce(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """A codec mode and its parameters, sorted by name, defaults filled in.

    Build one with :meth:`parse` or :meth:`from_dict` (they validate and fill
    defaults); the constructor validates too, so an invalid spec never exists.
    """

    mode: str
    params: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        table = MODES.get(self.mode)
        if table is None:
            raise ValueError(f"unknown codec mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        given = dict(self.params)
        if len(given) != len(self.params):
            raise ValueError(f"codec {self.mode}: a parameter is given twice in {self.params!r}")
        for name, value in given.items():
            param = table.get(name)
            if param is None:
                valid = ", ".join(table) or "none"
                raise ValueError(f"codec {self.mode}: unknown parameter {name!r}; valid parameters: {valid}")
            if not param.check(value):
                raise ValueError(f"codec {self.mode}: {name}={value!r} is invalid; expected {param.expected}")
        full = {name: given.get(name, param.default) for name, param in table.items()}
        object.__setattr__(self, "params", tuple(sorted(full.items())))

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        """Parse ``mode`` or ``mode:name=value,name=value`` (e.g. ``"int8:group=64"``)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"codec spec must be a non-empty string like 'int8:group=32'; got {text!r}")
        mode, _, rest = text.strip().partition(":")
        params: list[tuple[str, object]] = []
        for item in filter(None, (p.strip() for p in rest.split(","))):
            name, eq, value = item.partition("=")
            if not eq or not name.strip() or not value.strip():
                raise ValueError(f"codec spec {text!r}: parameter {item!r} is not name=value")
            params.append((name.strip(), _coerce(value.strip())))
        return cls(mode.strip().lower(), tuple(params))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CodecSpec:
        """Inverse of :meth:`to_dict`; ``params`` may be missing or partial."""
        if not isinstance(d, Mapping) or not isinstance(d.get("mode"), str):
            raise ValueError(f"codec spec dict needs a string 'mode'; got {d!r}")
        extra = set(d) - {"mode", "params"}
        if extra:
            raise ValueError(f"codec spec dict: unknown keys {sorted(extra)}; valid keys: mode, params")
        params = d.get("params") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"codec spec dict: params must be a map; got {params!r}")
        return cls(d["mode"], tuple(params.items()))

    def to_dict(self) -> dict[str, Any]:
        """msgpack/JSON-safe form, e.g. ``{"mode": "int8", "params": {"bits": 8, "group": 32}}``."""
        return {"mode": self.mode, "params": dict(self.params)}

    def get(self, name: str) -> Any:
        """The value of parameter ``name`` (defaults filled in)."""
        return dict(self.params)[name]

    @property
    def mode_id(self) -> int:
        """The mode's number in the frame header."""
        return _MODE_IDS[self.mode]

    @property
    def lossy(self) -> bool:
        """True when a decoded chunk may differ from the encoded one."""
        return self.mode in ("int8", "cachegen")

    @property
    def tag(self) -> str:
        """Namespace tag: mode, format version and decoding-relevant parameters; "" for ``none``.

        E.g. ``lossless.v1``, ``int8.v1-g32``, ``int8.v1-b4g32``, ``cachegen.v1-b4a16``.
        """
        if self.mode == "none":
            return ""
        table = MODES[self.mode]
        letters = "".join(
            f"{table[name].in_tag}{value}"
            for name, value in self.params
            if table[name].in_tag and not (self.mode == "int8" and name == "bits" and value == 8)
        )
        return f"{self.mode}.v{FORMAT_VERSION}" + (f"-{letters}" if letters else "")

    def __str__(self) -> str:
        if not self.params:
            return self.mode
        return self.mode + ":" + ",".join(f"{k}={v}" for k, v in self.params)
