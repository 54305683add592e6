"""Host-side page allocator of one KV group's pool: reference-counted pages and the prefix cache.

A page is either free, held (reference count > 0: in the page table of one or more sequences), or cached: its
content is final (every position committed) and it is findable under the hash of the tokens up to its end, so
a later request with the same prefix can point its page table at it instead of recomputing it. A cached page
nobody holds is evictable: it is handed out again, least recently released first, only when no free page is
left. So caching costs nothing while the pool has room: a page is reused when it would otherwise sit free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from gemma4_mtp_jax.model.kv_state import NULL_PAGE


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Pages 1..num_pages-1 (page 0 is the null page padding rows point to)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}  # held pages -> holders
        self._key_of: dict[int, Hashable] = {}  # cached pages -> key
        self._page_of: dict[Hashable, int] = {}  # key -> cached page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def allocate(self, n: int) -> list[int]:
        """`n` pages for one holder, their content undefined; evicts cached pages when no free page is left."""
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(p)]
            self._refs[p] = 1
            pages.append(p)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of `pages` (held or cached ones)."""
        for p in pages:
            if p in self._refs:
                self._refs[p] += 1
            elif p in self._evictable:
                del self._evictable[p]
                self._refs[p] = 1
            else:
                raise ValueError(f"page {p} shared but neither held nor cached")

    def free(self, pages: list[int]) -> None:
        """One holder fewer for each of `pages`; a page nobody holds goes back (a cached one stays findable)."""
        for p in pages:
            refs = self._refs.get(p)
            if refs is None:
                raise ValueError(f"page {p} freed but not allocated (double free?)")
            if refs > 1:
                self._refs[p] = refs - 1
                continue
            del self._refs[p]
            if p in self._key_of:
                self._evictable[p] = None
            else:
                self._free.append(p)

    def register(self, key: Hashable, page: int) -> None:
        """`page` (held) now has final content: findable under `key`. A key already cached keeps its page."""
        if page not in self._refs:
            raise ValueError(f"page {page} registered but not held")
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def lookup(self, key: Hashable) -> int | None:
        return self._page_of.get(key)

    def shared(self, page: int) -> bool:
        """Whether writing into held `page` would change what someone else reads: it is cached or has other holders."""
        return page in self._key_of or self._refs.get(page, 0) > 1

    def clear_cache(self) -> None:
        """Forget every cached page: those nobody holds become free, held ones stay held."""
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._key_of.clear()
        self._page_of.clear()

    def evictable(self, pages: list[int]) -> int:
        """How many of `pages` are cached pages nobody holds (sharing them takes them out of `num_free`)."""
        return sum(p in self._evictable for p in pages)
