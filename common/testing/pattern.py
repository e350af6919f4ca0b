"""A fast, exact KV pattern for ``HostPool``: fill a request's blocks, count wrong bytes.

The logical KV of request ``seed`` is ``L[layer, part, token, head, byte]``; its row for
(layer, part, token) -- all heads -- is read from a fixed random table at a seed-, layer-, part-
and position-dependent offset, so any misplaced, missing or stale byte is caught, at memcpy speed
(``host_pool.logical_kv`` draws a fresh random tensor per request, which is exact but several
seconds per GiB here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:
    from .host_pool import HostPool

_PATTERN_PERIOD = (16 << 20) + 4093  # odd: consecutive blocks never see the same bytes
_PATTERN_TAIL = 8 << 20  # longest contiguous run read without wrapping (one block part)
_pattern: np.ndarray | None = None


def _table() -> np.ndarray:
    global _pattern
    if _pattern is None:
        r = np.random.default_rng(0x6B76).integers(0, 256, _PATTERN_PERIOD, dtype=np.uint8)
        _pattern = np.concatenate((r, r[:_PATTERN_TAIL]))
    return _pattern


def _runs(pool: HostPool, seed: int, block_ids: Sequence[int], num_tokens: int,
          first_token: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (pool view, expected bytes) for every (block, layer, K/V) piece of the request."""
    g = pool.geometry
    row = g.num_kv_heads * g.vec_bytes
    lo, hi = g.head_range
    table = _table()
    if g.block_size * row > _PATTERN_TAIL:
        raise ValueError(f"block of {g.block_size * row} bytes exceeds the pattern tail")
    bases = [[(seed * 0x9E3779B1 + (layer * g.kv_parts + part) * 0x51ED27) % _PATTERN_PERIOD
              for part in range(g.kv_parts)] for layer in range(g.num_layers)]
    for j, b in enumerate(block_ids):
        t0 = first_token + j * g.block_size
        if t0 >= num_tokens:
            break
        n = min(g.block_size, num_tokens - t0)
        for layer in range(g.num_layers):
            for part in range(g.kv_parts):
                off = (bases[layer][part] + t0 * row) % _PATTERN_PERIOD
                want = table[off: off + n * row].reshape(n, g.num_kv_heads, g.vec_bytes)
                yield pool.block_view(layer, part, b)[:n], want[:, lo:hi]


def fill_pattern(pool: HostPool, seed: int, block_ids: Sequence[int], num_tokens: int,
                 first_token: int = 0) -> None:
    """Write tokens ``[first_token, num_tokens)`` of request ``seed`` into ``block_ids``."""
    for view, want in _runs(pool, seed, block_ids, num_tokens, first_token):
        view[...] = want


def verify_pattern(pool: HostPool, seed: int, block_ids: Sequence[int], num_tokens: int,
                   first_token: int = 0) -> int:
    """Number of bytes of tokens ``[first_token, num_tokens)`` in ``block_ids`` that are wrong."""
    bad = 0
    for view, want in _runs(pool, seed, block_ids, num_tokens, first_token):
        if not np.array_equal(view, want):
            bad += int(np.count_nonzero(view != want))
    return bad
