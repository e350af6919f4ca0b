"""Block ids for synthetic requests, as a busy server hands them out."""

from __future__ import annotations

import numpy as np


def fragmented_blocks(rng: np.random.Generator, num_blocks: int, count: int) -> list[int]:
    """Block ids as a busy server hands them out: mostly short runs, scattered over the pool."""
    if count > num_blocks:
        raise ValueError(f"need {count} blocks, pool has {num_blocks}")
    free = rng.permutation(num_blocks)
    out: list[int] = []
    taken: set[int] = set()
    i = 0
    while len(out) < count:
        start = int(free[i % num_blocks])
        i += 1
        run = int(rng.integers(1, 4))
        for b in range(start, min(start + run, num_blocks)):
            if b not in taken and len(out) < count:
                taken.add(b)
                out.append(b)
    return out
