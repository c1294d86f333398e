"""Matching, the scheduler connector's first job: how many tokens the daemon can add.

``get_num_new_matched_tokens(request, num_computed_tokens)``: the daemon is
asked how many leading chunks of the prompt it holds, and the prompt's
partial last chunk (its *tail*, stored under a key naming the exact prompt:
:func:`~lmcache_client.keys.tail_key`); everything up to the last prompt
token can be loaded, the last token is always computed so the request gets
logits.  Under tensor parallelism every rank's namespace is asked and the
smallest answer counts.  The answer is the hit beyond vLLM's own prefix
cache (``num_computed_tokens``, block aligned).

With asynchronous lookups (:mod:`.lookups`, the default) the answer is None
("ask again next step") while the lookup is out; an engine with nothing else
to run waits for it briefly instead.  A consumer that waits for a producer
(``load_wait_s``) answers None until the whole prompt is there or the
deadline passes, then takes what is there.  Calls have no effect beyond
remembering the latest answer, so vLLM may repeat them.

Requests whose KV depends on more than their tokens get keys of their own:
a LoRA adapter's name and a ``cache_salt`` are folded into the key chain's
root (:func:`~lmcache_client.keys.request_root`).  Multimodal requests and
prompt embeddings are neither loaded nor stored (their placeholder tokens do
not name their KV).

Primitives: :class:`Matcher` (a part of :class:`~.side.SchedulerSide`),
:func:`key_root`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from .... import keys as key_chain
from ....keys import request_root
from ...transfer import ChunkTransfer
from ..params import request_params
from .lookups import LookupService
from .perrequest import Hit, PerRequest, Wait
from .statescheduling import StateScheduling

logger = logging.getLogger(__name__)


def key_root(request: Any, tags: Sequence[str] = ()) -> bytes | None:
    """The key chain root of ``request``'s KV; None when its KV cannot be named by
    its tokens (multimodal inputs, prompt embeddings).  ``tags``: the request's
    ``lmcache_tags``, folded in like a ``cache_salt``."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    name = str(getattr(lora, "lora_name", None) or getattr(lora, "name", "")) if lora is not None else None
    salt = getattr(request, "cache_salt", None)
    return request_root(name, str(salt) if salt else None, tags)


class Matcher:
    """What the daemon holds of each waiting request's prompt (single-threaded, as vLLM's scheduler).

    ``transfers`` has one entry per tensor-parallel rank (the rank's namespace)."""

    IDLE_LOOKUP_WAIT_S = 0.05
    """An engine with nothing else to run waits this long for a lookup's answer."""
    POLL_S = 0.01
    """While a request waits for a producer, the daemon is asked at most this often;
    and when the engine has nothing else to run, each ask sleeps this long first."""

    def __init__(
        self,
        transfers: Sequence[ChunkTransfer],
        chunk_size: int,
        book: PerRequest,
        stats: dict[str, float],
        *,
        load: bool = True,
        load_wait_s: float = 0.0,
        lookups: LookupService | None = None,
        max_store_tokens: int = 0,
        load_deadline_ms: float = 0.0,
        states: StateScheduling | None = None,
    ):
        self._transfers = list(transfers)
        self.chunk_size = chunk_size
        self._book = book
        """Writes each asked request's params, root, vLLM request, hit and wait."""
        self._stats = stats
        self._load_enabled = load
        self._load_wait_s = load_wait_s
        self._lookups = lookups
        """Asynchronous lookups (:mod:`.lookups`); None: each lookup waits for the daemon."""
        self._max_store_tokens = max_store_tokens
        """The operator's cap on a request's ``lmcache_max_store_tokens`` (0: none)."""
        self._load_deadline_ms = load_deadline_ms
        """The operator's cap on a request's ``lmcache_load_deadline_ms`` (0: none)."""
        self._states = states
        """A Mamba hybrid: its lanes also look up states after the chunks; None: no Mamba group."""

    # -- get_num_new_matched_tokens -------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[str]:
        """The tiers of the leading chunks every rank's namespace holds (the first rank's tiers)."""
        tiers = self._transfers[0].lookup_tiers(keys)
        for transfer in self._transfers[1:]:
            if not tiers:
                break
            tiers = tiers[: transfer.lookup(keys[: len(tiers)])]
        return tiers

    def hit_sources(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the request's load per daemon tier (of the chunks it covers)."""
        hit = self._book.hits.get(req_id)
        if hit is None or num_external_tokens <= 0:
            return {}
        sources: dict[str, int] = {}
        start, end = hit.local_tokens, hit.local_tokens + num_external_tokens
        for i, tier in enumerate(hit.tiers):
            lo, hi = max(start, i * self.chunk_size), min(end, (i + 1) * self.chunk_size)
            if hi > lo:
                sources[tier] = sources.get(tier, 0) + hi - lo
        return sources

    def prompt_keys(self, prompt: Sequence[int], root: bytes) -> tuple[list[bytes], bytes | None]:
        """Keys of every full chunk of ``prompt`` and of its tail (None unless the
        prompt ends in a partial chunk of two or more tokens: a one-token tail
        holds only the last token, which is always computed): :func:`~lmcache_client.keys.prompt_keys`."""
        return key_chain.prompt_keys(prompt, self.chunk_size, root)

    def _daemon_down(self) -> bool:
        """Whether the daemon is down (its client's circuit breaker is open)."""
        return any(bool(t.client.fail_open_stats.get("down")) for t in self._transfers)

    def wait_s(self, request: Any) -> float:
        """How long this request waits for a producer: ``load_wait_s``, or the
        request's ``kv_transfer_params["lmcache_load_wait_s"]`` (a proxy's say),
        never more than ``load_wait_s``: the request comes from an end user, and
        an unbounded wait would hold the engine's scheduler slot forever."""
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and "lmcache_load_wait_s" in params:
            try:
                asked = float(params["lmcache_load_wait_s"])
            except (TypeError, ValueError):
                asked = math.nan
            if math.isnan(asked):
                logger.warning(
                    "request %s: ignoring lmcache_load_wait_s=%r", request.request_id, params["lmcache_load_wait_s"]
                )
            else:
                return min(max(0.0, asked), self._load_wait_s)
        return self._load_wait_s

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int, idle: bool) -> int | None:
        """Tokens the daemon can add beyond ``num_computed_tokens``; None: ask again next
        step.  ``idle``: the last step scheduled nothing (so a wait may sleep)."""
        req_id = request.request_id
        prompt = request.prompt_token_ids
        params = self._book.params[req_id] = request_params(
            request, max_store_tokens=self._max_store_tokens, load_deadline_ms=self._load_deadline_ms
        )
        root = key_root(request, params.tags)
        self._book.roots[req_id] = root
        self._book.requests[req_id] = request  # its block hashes (events) and its generated tokens (save_decode_cache)
        if not prompt or root is None or not self._load_enabled or params.skip_load:
            return 0
        n = len(prompt)
        full, tail = self.prompt_keys(prompt, root)
        best = n - 1 if tail is not None else min(n - 1, len(full) * self.chunk_size)
        if best <= num_computed_tokens:
            return 0  # vLLM's own cache already holds every token the daemon could add
        keys = full + [tail] if tail is not None else full
        wait_s = self.wait_s(request)
        now = time.monotonic()
        waiting = self._book.waiting.get(req_id)
        if self._lookups is not None:
            found = self._async_lookup(req_id, keys, waiting, now, len(full), idle)
            if found is None:
                return None
            tiers, daemon_down = found
        else:
            if waiting is not None and idle:
                # vLLM's engine loop spins while a request is deferred; with nothing else to
                # run it would take whole cores from the producer it is waiting for.
                time.sleep(self.POLL_S)
                now = time.monotonic()
            elif waiting is not None and now - waiting.last < self.POLL_S:
                return None
            started = time.perf_counter()
            tiers = self.lookup(keys)
            self._stats["lookups"] += 1
            self._stats["lookup_s"] += time.perf_counter() - started
            daemon_down = self._daemon_down()  # nothing will arrive: do not wait
        if len(tiers) < len(keys) and wait_s > 0 and not daemon_down:
            if waiting is None:
                self._stats["load_waits"] += 1
                waiting = self._book.waiting[req_id] = Wait(now, now)
            if now - waiting.first < wait_s:
                waiting.last = now
                if self._lookups is not None:
                    self._lookups.forget(req_id)  # ask again after POLL_S
                return None
            self._stats["load_wait_expired"] += 1
            logger.warning(
                "request %s: %d of %d chunks arrived in %.1f s (load_wait_s); computing the rest",
                req_id,
                len(tiers),
                len(keys),
                wait_s,
            )
        if waiting is not None:
            self._stats["load_wait_s"] += now - waiting.first
            del self._book.waiting[req_id]
        self._book.hits[req_id] = Hit(num_computed_tokens, len(tiers), tiers)
        covered = n if len(tiers) > len(full) else len(tiers) * self.chunk_size
        return max(0, min(covered, n - 1) - num_computed_tokens)

    def _async_lookup(
        self, req_id: str, keys: list[bytes], waiting: Wait | None, now: float, n_full: int, idle: bool
    ) -> tuple[list[str], bool] | None:
        """The request's lookup answer (tiers, daemon down), or None while it is out.
        An engine with nothing else to run waits for it (no decode is held up)."""
        assert self._lookups is not None
        if not self._lookups.asked(req_id):
            if waiting is not None and now - waiting.last < self.POLL_S:
                if not idle:
                    return None
                time.sleep(self.POLL_S)
            # a Mamba hybrid's lanes also find the longest stored state the chunk hit allows
            then = self._states.lookup_then(req_id, keys[:n_full]) if self._states is not None else None
            self._lookups.ask(req_id, keys, then)
        answer = self._lookups.answer(req_id, self.IDLE_LOOKUP_WAIT_S if idle else 0.0)
        if answer is None:
            return None
        if not answer.counted:
            answer.counted = True
            self._stats["lookups"] += 1
            self._stats["lookup_s"] += answer.seconds
        return answer.tiers, answer.daemon_down
