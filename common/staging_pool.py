"""Slots in a staging pool: first-fit byte ranges of one registered buffer.

Pure python, no memory of its own: the pool hands out ``(offset, length)`` ranges of a buffer
of ``size`` bytes that the caller allocated and registered once (with NIXL, on the device). Every
range starts at a multiple of ``align`` from the buffer's start and its length is the request
rounded up to ``align``. Free ranges are kept sorted by offset and coalesced with their
neighbours on release; ``reserve`` takes the first free range that fits (O(free ranges), few).

Not thread-safe: one owner (the transfer thread) reserves and releases. A slot must only be
released when nothing can touch it any more (its unpack completed and every chunk of every
writer is accounted for, or the transfer was fenced); the pool cannot tell.
"""

from __future__ import annotations

import bisect
import operator

__all__ = ["StagingPool"]


class StagingPool:
    def __init__(self, size: int, *, align: int = 4096):
        size = operator.index(size)
        align = operator.index(align)
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a positive power of two, got {align}")
        if size < 0:
            raise ValueError(f"size must not be negative, got {size}")
        self.size = size
        self.align = align
        self.capacity = size - size % align  # the usable bytes
        self._starts: list[int] = [0] if self.capacity else []  # free ranges, sorted
        self._free: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._used: dict[int, int] = {}  # offset -> length of reserved ranges
        self.used_bytes = 0
        self.peak_bytes = 0
        self.reserves = 0  # successful reserve() calls
        self.releases = 0
        self.exhausted = 0  # reserve() calls that found no free range large enough
        self.too_large = 0  # of those: larger than the whole pool

    # -- queries ---------------------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return max(self._free.values(), default=0)

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of every free range, by offset (for tests and metrics)."""
        return [(s, self._free[s]) for s in self._starts]

    @property
    def reserved(self) -> dict[int, int]:
        """offset -> length of every reserved range."""
        return dict(self._used)

    def stats(self) -> dict[str, int]:
        return {"capacity": self.capacity, "used_bytes": self.used_bytes,
                "peak_bytes": self.peak_bytes, "largest_free": self.largest_free,
                "slots": len(self._used), "reserves": self.reserves, "releases": self.releases,
                "exhausted": self.exhausted, "too_large": self.too_large}

    # -- changes ---------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> tuple[int, int] | None:
        """``(offset, length)`` of a free range of at least ``nbytes`` bytes (``length`` is
        ``nbytes`` rounded up to ``align``), or None when no free range is large enough (counted
        in ``exhausted``). ``nbytes`` must be positive."""
        nbytes = operator.index(nbytes)
        if nbytes <= 0:
            raise ValueError(f"a slot must have a positive size, got {nbytes}")
        length = -(-nbytes // self.align) * self.align
        for i, start in enumerate(self._starts):
            have = self._free[start]
            if have < length:
                continue
            del self._free[start]
            if have == length:
                del self._starts[i]
            else:
                self._starts[i] = start + length
                self._free[start + length] = have - length
            self._used[start] = length
            self.used_bytes += length
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            self.reserves += 1
            return start, length
        self.exhausted += 1
        if length > self.capacity:
            self.too_large += 1
        return None

    def release(self, offset: int) -> int:
        """Free the range reserved at ``offset``; return its length. KeyError if no range is
        reserved there (a double release is a bug in the caller)."""
        offset = operator.index(offset)
        length = self._used.pop(offset, None)
        if length is None:
            raise KeyError(f"no slot reserved at offset {offset}")
        self.used_bytes -= length
        self.releases += 1
        i = bisect.bisect_left(self._starts, offset)
        start, end = offset, offset + length
        if i < len(self._starts) and self._starts[i] == end:  # merge with the next free range
            end += self._free.pop(end)
            del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._free[prev] == start:  # merge into the previous free range
                self._free[prev] = end - prev
                return length
        self._starts.insert(i, start)
        self._free[start] = end - start
        return length
