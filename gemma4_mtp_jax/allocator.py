"""Host-side page allocator of one KV group's pool."""

from __future__ import annotations

from gemma4_mtp_jax.kv_state import NULL_PAGE


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free list over pages 1..num_pages-1 (page 0 is the null page padding rows point to)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} freed but not allocated (double free?)")
            self._used.remove(p)
            self._free.append(p)
