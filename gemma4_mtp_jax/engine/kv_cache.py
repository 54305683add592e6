"""The engine's KV cache on the host side: each group's page allocator, the slots of the device state, which
pages and slot each sequence holds, the prefix cache (docs/DESIGN.md, "Prefix cache") and the sliding rings.

A request holds none of this: the manager keeps a `SeqKV` per request it serves and gives back the request's
page tables. Admission, growth and preemption are decided by the scheduler, which asks the manager what fits.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from gemma4_mtp_jax.engine.allocator import PageAllocator
from gemma4_mtp_jax.engine.request import Request
from gemma4_mtp_jax.model.kv_state import NULL_PAGE, KVLayout

Cached = dict[str, tuple[int, list[int]]]  # group -> (first logical page, the cached pages from it)


def page_keys(tokens: list[int], page_size: int, num_pages: int, known: list[bytes] = (),
              media: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:
    """The prefix cache's keys of the first `num_pages` pages of `tokens` (`known`: the first ones, already
    computed): key j hashes key j-1 and the tokens of page j, so equal keys mean equal tokens at every position up
    to the page's end (and so equal K/V). `media`: (first, end position, content digest) of each image or clip
    (engine/media.PromptMedia.spans); a page also hashes the digests of the items it covers, since placeholders
    alone say nothing of the soft tokens they stand for."""
    keys = list(known)
    while len(keys) < num_pages:
        j = len(keys)
        lo, hi = j * page_size, (j + 1) * page_size
        chunk = np.asarray(tokens[lo:hi], np.int32).tobytes()
        chunk += b"".join(d for first, end, d in media if first < hi and end > lo)
        keys.append(hashlib.blake2b((keys[-1] if j else b"") + chunk, digest_size=16).digest())
    return keys


@dataclasses.dataclass
class SeqKV:
    """One sequence's share of the cache: its slot, its pages per group (a sliding group: its ring, by slot), and
    for the prefix cache the chained hash of its tokens up to the end of each full page, how many of its pages are
    registered, and per ring the next logical page to enter (its slot is re-pointed if shared)."""

    slot: int | None = None
    pages: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    page_keys: list[bytes] = dataclasses.field(default_factory=list)
    registered: int = 0
    ring_next: dict[str, int] = dataclasses.field(default_factory=dict)


class KVCacheManager:
    """Pages of every KV group of `layout` and `num_slots` slots. `reach`: how far back a sliding layer still reads
    from a sequence's first new query (the target's window, or the drafter's W+1 committed keys)."""

    def __init__(self, layout: KVLayout, num_slots: int, prefix_caching: bool, reach: int):
        self.layout = layout
        self.prefix_caching = prefix_caching
        self.reach = reach
        self.allocators = {g: PageAllocator(layout.pages(g)) for g, _ in layout.pages_per_seq}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self._seqs: dict[Request, SeqKV] = {}
        # Prefix cache, in tokens: looked up at admission, and found.
        self.queries = 0
        self.hits = 0

    def seq(self, req: Request) -> SeqKV:
        """`req`'s share (made on first use: a waiting request's page keys are computed before it is admitted)."""
        return self._seqs.setdefault(req, SeqKV())

    def pages_in_use(self) -> dict[str, int]:
        return {g: a.num_used for g, a in self.allocators.items()}

    def pages_total(self) -> dict[str, int]:
        return {g: a.capacity for g, a in self.allocators.items()}

    def page_table(self, req: Request) -> dict[str, np.ndarray]:
        """`req`'s page table row per group: [table width] int32, NULL_PAGE past its pages."""
        pages, tables = self.seq(req).pages, {}
        for g, width in self.layout.pages_per_seq:
            t = np.full((width,), NULL_PAGE, np.int32)
            t[: len(pages[g])] = pages[g]
            tables[g] = t
        return tables

    # ------------------------------------------------------------------ growth
    def pages_short(self, req: Request, tokens: int) -> dict[str, int]:
        """Pages `req` still lacks per group to hold `tokens` tokens."""
        pages = self.seq(req).pages
        return {g: self.layout.pages_needed(g, tokens) - len(pages.get(g, ())) for g in self.allocators}

    def fits(self, shorts: list[dict[str, int]]) -> bool:
        """Whether the free pool gives every one of these page needs at once."""
        return all(sum(max(s[g], 0) for s in shorts) <= a.num_free for g, a in self.allocators.items())

    def grow(self, req: Request, short: dict[str, int], last_page: int) -> None:
        """Take `short` more pages for `req` (one group at a time: releasing it frees what was taken if one fails),
        then prepare its rings for writes up to logical page `last_page` (`advance_rings`)."""
        pages = self.seq(req).pages
        for g, n in short.items():
            if n > 0:
                pages[g] = pages.get(g, []) + self.allocators[g].allocate(n)
        self.advance_rings(req, last_page)

    def advance_rings(self, req: Request, last_page: int) -> None:
        """Before a program writes up to logical page `last_page`: a sliding ring slot about to take a new logical
        page gets a fresh page if its current one is shared (cached or held by another sequence), so cached K/V
        is never overwritten. Without the prefix cache nothing is shared and the ring is overwritten in place."""
        if not self.prefix_caching:
            return
        seq = self.seq(req)
        for g, alloc in self.allocators.items():
            R = self.layout.ring_pages(g)
            if R is None:
                continue
            pages = seq.pages[g]
            for j in range(seq.ring_next.get(g, 0), last_page + 1):
                if alloc.shared(pages[j % R]):
                    alloc.free([pages[j % R]])
                    pages[j % R] = alloc.allocate(1)[0]
            seq.ring_next[g] = max(seq.ring_next.get(g, 0), last_page + 1)

    # ------------------------------------------------------------------ admission
    def cached_prefix(self, req: Request) -> tuple[int, Cached]:
        """The most full pages of `req`'s tokens (all but the newest, and at least one token left to prefill) whose
        K/V the cache holds: every page for full layers, the window's for sliding rings. Returns (pages,
        {group: (first logical page, cached pages from it)}); (0, {}) with the cache off or on a miss."""
        if not self.prefix_caching or req.sampling.uses_history or req.sampling.prompt_logprobs is not None:
            # Penalties count the tokens a prefill passes (device_state.prefill_history), and prompt logprobs come
            # from it: such a request computes its pages itself.
            return 0, {}
        limit = (req.prefill_len - 1) // self.layout.page_size
        if limit <= 0:
            return 0, {}
        keys = self._keys(req, limit)
        n = limit
        for g, alloc in self.allocators.items():
            if self.layout.ring_pages(g) is None:
                j = 0
                while j < n and alloc.lookup(keys[j]) is not None:
                    j += 1
                n = j
        while n > 0:
            if req.media is not None and req.media.inside(n * self.layout.page_size):
                n -= 1  # the rest of the prefill would begin inside an image kept whole (PromptMedia.whole)
                continue
            found = {}
            for g, alloc in self.allocators.items():
                lo = 0 if self.layout.ring_pages(g) is None else self._window_first_page(n)
                pages = [alloc.lookup(key) for key in keys[lo:n]]
                if None in pages:
                    break
                found[g] = (lo, pages)
            else:
                return n, found
            n -= 1
        return 0, {}

    def admission_fits(self, short: dict[str, int], cached: Cached, running: int) -> bool:
        """Whether a request lacking `short` pages, `cached` of them shared from the cache, fits the free pool while
        a page per running sequence stays free in each growing group (admitting must not force a preemption at the
        next step). The cached pages are shared, not taken: fewer fresh ones, but the evictable ones count."""
        for g, alloc in self.allocators.items():
            need = short[g]
            if g in cached:
                need += alloc.evictable(cached[g][1]) - len(cached[g][1])
            reserve = 0 if self.layout.ring_pages(g) else running
            if need + reserve > alloc.num_free:
                return False
        return True

    def admit(self, req: Request, n_cached: int, cached: Cached) -> None:
        """The pages of an admitted request, and a slot: the cached prefix shared, fresh pages for the rest (a
        sliding ring: the cached window's pages in their slots, fresh ones in the others). Sets `req.prefilled` to
        the positions found in the cache."""
        seq = self.seq(req)
        for g, alloc in self.allocators.items():  # one group at a time: releasing frees what was taken if one fails
            lo, shared = cached.get(g, (0, []))
            alloc.share(shared)
            R = self.layout.ring_pages(g)
            if R is None:
                seq.pages[g] = list(shared)
                seq.pages[g] += alloc.allocate(self.layout.pages_needed(g, req.num_tokens) - len(shared))
            else:
                slots: list[int | None] = [None] * R
                for j, page in zip(range(lo, n_cached), shared):
                    slots[j % R] = page
                seq.pages[g] = [p for p in slots if p is not None]  # held so far (freed if the next line raises)
                fresh = iter(alloc.allocate(slots.count(None)))
                seq.pages[g] = [p if p is not None else next(fresh) for p in slots]
                seq.ring_next[g] = n_cached
        seq.registered = n_cached
        req.prefilled = n_cached * self.layout.page_size
        if self.prefix_caching:  # counted once per admission, not per step a request waits
            self.queries += req.prefill_len
            self.hits += req.prefilled
        seq.slot = self.free_slots.pop()

    # ------------------------------------------------------------------ the prefix cache
    def register(self, req: Request) -> None:
        """Put `req`'s newly complete pages (every position's K/V committed) in the prefix cache."""
        seq = self._seqs.get(req)
        if not self.prefix_caching or seq is None or not seq.pages:
            return
        n = req.committed // self.layout.page_size
        if n <= seq.registered:
            return
        keys = self._keys(req, n)
        for j in range(seq.registered, n):
            for g, alloc in self.allocators.items():
                R = self.layout.ring_pages(g)
                if R is None:
                    alloc.register(keys[j], seq.pages[g][j])
                elif j >= seq.ring_next.get(g, 0) - R:  # still in its slot
                    alloc.register(keys[j], seq.pages[g][j % R])
        seq.registered = n

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (vLLM's reset_prefix_cache): later requests recompute their prefixes."""
        for alloc in self.allocators.values():
            alloc.clear_cache()

    def _keys(self, req: Request, num_pages: int) -> list[bytes]:
        """`req`'s page keys up to `num_pages` pages (`page_keys`), kept as they are computed."""
        keys = self.seq(req).page_keys
        if len(keys) < num_pages:
            media = req.media.spans if req.media is not None else ()
            keys[:] = page_keys(req.prompt + req.output, self.layout.page_size, num_pages, keys, media)
        return keys

    def _window_first_page(self, num_pages: int) -> int:
        """The oldest logical page a sequence resuming after `num_pages` full pages still reads in a sliding
        layer."""
        ps = self.layout.page_size
        return max(0, (num_pages * ps - self.reach) // ps)

    # ------------------------------------------------------------------ release
    def release(self, req: Request, *, cache: bool, finished: bool) -> None:
        """Give back `req`'s slot and pages; with `cache`, its complete pages stay in the prefix cache first. A
        finished request is forgotten; a preempted one keeps its page keys (its tokens stay the same)."""
        if cache:
            self.register(req)
        seq = self._seqs.pop(req, None) if finished else self._seqs.get(req)
        if seq is None:
            return
        slot, seq.slot = seq.slot, None
        if slot is not None:
            self.free_slots.append(slot)
        pages, seq.pages = seq.pages, {}
        ring_next, seq.ring_next, seq.registered = seq.ring_next, {}, 0
        for g, group_pages in pages.items():
            # Newest logical page first: eviction (least recently released first) then takes a cached prefix from
            # its end, and its first pages (for a ring, the oldest of its window), which later lookups need before
            # the others, stay findable longest.
            R = self.layout.ring_pages(g)
            if R is not None and g in ring_next:
                newest = ring_next[g] - 1
                group_pages = [group_pages[j % R] for j in range(newest - R + 1, newest + 1)]
            self.allocators[g].free(group_pages[::-1])
