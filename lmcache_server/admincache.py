"""The operator's cache commands of ``lmcache-server admin`` (docs/operations.md).

- ``pin`` / ``unpin`` / ``delete`` / ``prefetch --namespace NS PROMPT`` (or ``--model M``:
  every namespace of that model the daemon holds, as ``admin who-has --model`` and
  ``POST /query`` pick them: :func:`lmcache_client.namespace.of_model`): act on the
  chunks of one prompt, given as ``--tokens 1,2,3``, ``--tokens-file F`` (token ids
  separated by commas or white space, or a JSON array) or ``--text "..."
  --tokenizer PATH`` (a tokenizer.json, or a folder holding one; read with the
  ``tokenizers`` library, else ``transformers``).  ``--salt`` (the request's
  ``cache_salt``) and ``--tags a,b`` (its ``lmcache_tags``) name the key chain's
  root; ``--chunk-size`` defaults to the namespace's ``c<N>`` field, else the daemon's.
- ``namespace --namespace NS`` (or ``--model M``; a bare ``NS`` is accepted too, the
  older form): what the namespace holds, per tier, and what of it is pinned.

The keys are the vLLM connector's, computed by the engine-neutral code the
connector calls too (the daemon imports no engine adapter): the root is
:func:`lmcache_client.keys.request_root` of that salt and tags (no LoRA adapter),
then :func:`lmcache_client.keys.prompt_keys`: every full chunk's key and the key of
the prompt's partial last chunk (its tail, when it has two tokens or more).  A
prompt of more chunks than the daemon takes keys in one request is refused.

Primitives: :func:`add_commands`, :func:`run_command`, :func:`prompt_keys`,
:func:`read_tokens`, :class:`PromptError`, :class:`NoNamespace`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache_client import CacheClient
from lmcache_client import keys as key_chain
from lmcache_client.namespace import chunk_size_of, of_model

PROMPT_COMMANDS = ("pin", "unpin", "delete", "prefetch")
MAX_TOKEN_ID = 2**32 - 1
MAX_TAGS = 16
"""As the connector's ``lmcache_tags``."""
MAX_FILE_BYTES = 64 << 20
"""A tokens file or a text larger than this is refused (no prompt is that long)."""


class PromptError(ValueError):
    """Bad prompt input (token ids, files, tokenizer, tags): exit 2 with this message."""


class NoNamespace(LookupError):
    """``--model`` names no namespace the daemon holds: exit 1 with this message (nothing
    cached yet is not bad usage)."""


def add_target(p: argparse.ArgumentParser, required: bool = True, positional: bool = False) -> None:
    """``--namespace NS`` or ``--model M``, the one way every cache command names its
    namespaces (``positional``: a bare ``NS`` too, the form ``namespace`` had first)."""
    which = p.add_mutually_exclusive_group(required=required and not positional)
    which.add_argument("--namespace", metavar="NS", help="the namespace string (admin namespaces lists them)")
    which.add_argument("--model", metavar="MODEL", help="every namespace of this model id the daemon holds")
    if positional:
        p.add_argument("name", nargs="?", metavar="NS", help="the namespace string (same as --namespace NS)")


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """The cache commands' subparsers, under ``lmcache-server admin``."""
    helps = {
        "pin": "keep a prompt's chunks in memory (promoted from disk/Redis first)",
        "unpin": "let a prompt's pinned chunks be evicted again",
        "delete": "remove a prompt's chunks from every tier",
        "prefetch": "promote a prompt's chunks from disk/Redis into memory",
    }
    for name in PROMPT_COMMANDS:
        p = sub.add_parser(name, parents=[common], help=helps[name])
        add_target(p)
        given = p.add_mutually_exclusive_group(required=True)
        given.add_argument("--tokens", metavar="IDS", help="the prompt's token ids: 1,2,3")
        given.add_argument("--tokens-file", metavar="FILE", help="token ids separated by commas/space, or JSON")
        given.add_argument("--text", help="the prompt as text (with --tokenizer)")
        p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or a folder holding the model's tokenizer")
        p.add_argument(
            "--no-special-tokens", action="store_true", help="--text: add no BOS etc. (default: as vLLM does)"
        )
        p.add_argument(
            "--chunk-size",
            type=int,
            metavar="N",
            help="tokens per chunk (default: the namespace's c<N>, else the daemon's)",
        )
        p.add_argument("--salt", metavar="S", help="the requests' cache_salt")
        p.add_argument("--tags", metavar="A,B", help="the requests' lmcache_tags")
    listing = sub.add_parser("namespace", parents=[common], help="a namespace's chunks and bytes per tier, pinned")
    add_target(listing, positional=True)


def _parse_ids(text: str, where: str) -> list[int]:
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise PromptError(f"{where}: not a JSON array of token ids ({err})") from None
        if not isinstance(values, list):
            raise PromptError(f"{where}: not a JSON array of token ids")
    else:
        values = [v for v in re.split(r"[\s,]+", text) if v]
    out: list[int] = []
    for i, value in enumerate(values):
        try:
            token = value if type(value) is int else int(str(value), 10)
        except ValueError:
            raise PromptError(f"{where}: token {i} is {str(value)[:40]!r}, not an integer") from None
        if not 0 <= token <= MAX_TOKEN_ID:
            raise PromptError(f"{where}: token {i} is {token}, outside 0..{MAX_TOKEN_ID}")
        out.append(token)
    if not out:
        raise PromptError(f"{where}: no token ids")
    return out


def _read_file(path: str, what: str) -> str:
    try:
        p = Path(path)
        if p.stat().st_size > MAX_FILE_BYTES:
            raise PromptError(f"{what} {path} is larger than {MAX_FILE_BYTES >> 20} MiB")
        return p.read_text()
    except OSError as err:
        raise PromptError(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise PromptError(f"{what} {path} is not UTF-8 text") from None


def _tokenize(text: str, tokenizer: str, special_tokens: bool) -> list[int]:
    path = Path(tokenizer)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not path.exists():
        raise PromptError(f"--tokenizer {tokenizer}: no such file or folder")
    if file.is_file() and importlib.util.find_spec("tokenizers") is not None:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as err:  # the library's own error types vary by version
            raise PromptError(f"--tokenizer {file}: not a tokenizer.json ({err})") from None
        return list(tok.encode(text, add_special_tokens=special_tokens).ids)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise PromptError(
            "--text needs the `tokenizers` library (pip install tokenizers) and a tokenizer.json, "
            "or `transformers`; neither is installed"
        ) from None
    try:
        auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        raise PromptError(f"--tokenizer {tokenizer}: transformers cannot load it ({err})") from None
    return list(auto(text, add_special_tokens=special_tokens)["input_ids"])


def read_tokens(args: argparse.Namespace) -> list[int]:
    """The prompt's token ids from ``--tokens``, ``--tokens-file`` or ``--text`` + ``--tokenizer``."""
    if args.text is not None:
        if not args.tokenizer:
            raise PromptError("--text needs --tokenizer PATH (the model's tokenizer.json or its folder)")
        if len(args.text.encode()) > MAX_FILE_BYTES:
            raise PromptError(f"--text is larger than {MAX_FILE_BYTES >> 20} MiB")
        tokens = _tokenize(args.text, args.tokenizer, not args.no_special_tokens)
        if not tokens:
            raise PromptError("--text gives no tokens")
        return tokens
    if args.tokenizer:
        raise PromptError("--tokenizer goes with --text only")
    if args.tokens_file is not None:
        return _parse_ids(_read_file(args.tokens_file, "tokens file"), args.tokens_file)
    return _parse_ids(args.tokens, "--tokens")


def _tags(value: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    tags = [t.strip() for t in value.split(",")]
    if not all(tags) or len(tags) > MAX_TAGS:
        raise PromptError(f"--tags: at most {MAX_TAGS} non-empty tags separated by commas, got {value!r}")
    return tuple(sorted(set(tags)))  # a set, as the connector reads lmcache_tags


def prompt_keys(
    tokens: Sequence[int], chunk_size: int, salt: str | None = None, tags: str | None = None
) -> list[bytes]:
    """The keys the vLLM connector stores ``tokens``' KV under: each full chunk's, then the tail's."""
    if chunk_size < 1:
        raise PromptError(f"--chunk-size must be positive, got {chunk_size}")
    root = key_chain.request_root(None, salt or None, _tags(tags))
    keys, tail = key_chain.prompt_keys(tokens, chunk_size, root)
    return keys if tail is None else [*keys, tail]


def target_namespaces(args: argparse.Namespace, client: CacheClient) -> list[str]:
    """The namespaces a cache command acts on: ``--namespace NS`` (or a bare ``NS``), else
    every one of ``--model M`` the daemon holds (listing them needs the admin role under
    ``auth: curve``; a tenant's key names its namespace)."""
    name = getattr(args, "name", None)
    given: list[str] = [v for v in (name, args.namespace) if v is not None]
    if len(given) > 1 or (given and args.model is not None):
        raise PromptError("name the namespace once: NS, --namespace NS or --model MODEL")
    if given:
        return given
    if args.model is None:
        raise PromptError("give --namespace NS or --model MODEL")
    found = of_model(sorted(client.stats().get("namespaces", {})), args.model)
    if not found:
        raise NoNamespace(f"the daemon holds no namespace of model {args.model!r} (admin namespaces lists them)")
    return found


def _chunk_size(args: argparse.Namespace, namespace: str, hello: dict[str, Any]) -> int:
    """``--chunk-size``, else the namespace's ``c<N>`` field (what its engine chunks by), else the daemon's."""
    if args.chunk_size is not None:
        return int(args.chunk_size)
    return chunk_size_of(namespace) or int(hello["chunk_size"])


def _keys(args: argparse.Namespace, tokens: list[int], chunk_size: int, max_keys: int) -> list[bytes]:
    if chunk_size < 1:
        raise PromptError(f"--chunk-size must be positive, got {chunk_size}")
    if len(tokens) > (max_keys + 1) * chunk_size:  # checked before hashing: a huge file costs nothing
        raise PromptError(
            f"the prompt has {len(tokens)} tokens, {len(tokens) // chunk_size} chunks of {chunk_size}: "
            f"the daemon takes at most {max_keys} keys per request (max_keys_per_request)"
        )
    keys = prompt_keys(tokens, chunk_size, args.salt, args.tags)
    if len(keys) > max_keys:
        raise PromptError(
            f"the prompt has {len(keys)} chunks: the daemon takes at most {max_keys} keys per request "
            "(max_keys_per_request)"
        )
    if not keys:
        raise PromptError(f"the prompt ({len(tokens)} token) has no chunk the connector stores")
    return keys


def run_command(args: argparse.Namespace, client: CacheClient) -> tuple[dict[str, Any], str]:
    """Run a cache command: (its JSON result, its text).  With ``--model`` the result is
    ``{"model": M, "namespaces": [one result per namespace]}`` and a text line for each."""
    if args.command == "namespace":
        listings = [dict(client.stats(namespace=ns)["namespace"]) for ns in target_namespaces(args, client)]
        if args.model is None:
            return listings[0], format_listing(listings[0])
        return {"model": args.model, "namespaces": listings}, "\n\n".join(map(format_listing, listings))
    hello = client.hello("lmcache-server-admin")
    tokens = read_tokens(args)
    max_keys = int(hello["max_keys_per_request"])
    # Every namespace's keys are checked before any is acted on: a refused prompt changes nothing.
    planned = [
        (ns, _keys(args, tokens, _chunk_size(args, ns, hello), max_keys)) for ns in target_namespaces(args, client)
    ]
    results = [_act(args.command, client, ns, keys) for ns, keys in planned]
    if args.model is None:
        return results[0]
    return {"model": args.model, "namespaces": [out for out, _ in results]}, "\n".join(text for _, text in results)


def _act(command: str, client: CacheClient, ns: str, keys: list[bytes]) -> tuple[dict[str, Any], str]:
    """One prompt command on one namespace's keys: (its JSON result, its text line)."""
    n = len(keys)
    out: dict[str, Any] = {"namespace": ns, "chunks": n}
    if command == "prefetch":
        result = client.prefetch(keys, namespace=ns)
        in_memory = sum(result.in_memory)
        out.update(
            in_memory=in_memory,
            was_in_memory=result.was_in_memory,
            promoted=result.promoted,
            promoted_bytes=result.promoted_bytes,
            declined=result.declined,
            not_found=n - in_memory - result.declined,
        )
        text = (
            f"prefetch of {n} chunks in {ns}: {in_memory} in memory now ({result.was_in_memory} were, "
            f"{result.promoted} promoted, {_bytes(result.promoted_bytes)}), {result.declined} left below "
            f"(no room in the in-flight budget or memory: retry), {out['not_found']} not found"
        )
        return out, text
    done = {"pin": client.pin, "unpin": client.unpin, "delete": client.delete}[command](keys, namespace=ns)
    acted = sum(done)
    word, other = {
        "pin": ("pinned", "not pinned (no tier holds them, or no room to promote them)"),
        "unpin": ("unpinned", "not pinned or not stored"),
        "delete": ("deleted", "not found"),
    }[command]
    out.update({word: acted, "not_acted": n - acted})
    return out, f"{word} {acted} of {n} chunks in {ns}; {n - acted} {other}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_listing(listing: dict[str, Any]) -> str:
    """A ``stats`` reply's ``namespace`` map as one row per tier."""
    rows = [("memory", listing.get("chunks", 0), listing.get("stored_bytes", 0))]
    rows += [
        (name.removesuffix("_chunks"), count, listing.get(name.removesuffix("_chunks") + "_stored_bytes", 0))
        for name, count in listing.items()
        if name.endswith("_chunks") and name != "pinned_chunks"
    ]
    lines = [f"namespace {listing.get('name')}", f"{'tier':<8} {'chunks':>10} {'stored':>12}"]
    lines += [f"{tier:<8} {count:>10} {_bytes(nbytes):>12}" for tier, count, nbytes in rows]
    lines.append(
        f"pinned: {listing.get('pinned_chunks', 0)} chunks, {_bytes(listing.get('pinned_bytes', 0))} (in memory)"
    )
    lines.append("(Redis, where there is one, keeps no per-namespace count)")
    return "\n".join(lines)
