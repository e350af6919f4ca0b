"""This process's memory, as the soak benchmarks read it: resident set, glibc's heap, Python's
allocated blocks."""

from __future__ import annotations

import ctypes
import sys
from functools import lru_cache
from pathlib import Path


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    """glibc, loaded once (a load per reading would itself show up as growth)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc


def reading() -> dict[str, int]:
    """``rss`` (``VmRSS``), ``heap_in_use`` (glibc: allocated chunks + mmapped ones), ``arena``,
    ``mmapped`` (bytes), ``py_blocks`` (``sys.getallocatedblocks``)."""
    info = _libc().mallinfo2()
    rss = next((int(line.split()[1]) for line in
                Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmRSS:")), 0) * 1024
    return {"rss": rss, "heap_in_use": info.uordblks + info.hblkhd, "arena": info.arena,
            "mmapped": info.hblkhd, "py_blocks": sys.getallocatedblocks()}


def malloc_trim() -> None:
    """Give glibc's free heap back to the system (what a trim returns was not held)."""
    _libc().malloc_trim(0)
