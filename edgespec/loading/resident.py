"""What a loaded CPU process keeps resident: freed C heap and torch's start-up code given back to the OS.

Two things stay mapped after loading that a serving process does not use again:

* freed memory inside the malloc arenas: the ``tokenizers`` library's parse of the demo's 3.3 MB
  ``tokenizer.json`` peaks about 33 MB above the tokenizer it builds, and glibc keeps those pages for later
  allocations of that size, which never come. :func:`trim_heap` returns them (``malloc_trim``).
* the code pages ``import torch`` ran once: libtorch's static initialisers (operator registration) touch code all
  over its 200+ MB text, and file pages are mapped in whole large folios (2 MB on a recent kernel's ext4), so about
  90 MB of libtorch stays mapped. :func:`drop_library_text` unmaps the executable pages of torch's libraries;
  they stay in the page cache, and the code a step runs is mapped again on its first use (a page fault, no
  read). Only mappings with no private (written) pages are dropped: an executable mapping of a position-
  independent library is never written, and its pages are the file's, so nothing is lost.

Elsewhere (no ``libc.so.6``, no ``/proc/self/smaps``, another OS) both do nothing: the memory is merely kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
from pathlib import Path

import numpy as np

_MADV_DONTNEED, _MADV_NOHUGEPAGE = 4, 15
_PAGE = os.sysconf("SC_PAGE_SIZE")
# The libraries whose text is dropped: torch's own (its CPU kernels and the Python bindings).
LIBRARIES = ("libtorch_cpu.so", "libtorch_python.so")
_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(\S*)")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def trim_heap() -> bool:
    """Return the free pages of every malloc arena to the OS; True when glibc's ``malloc_trim`` ran."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def text_mappings(names: tuple[str, ...] = LIBRARIES, smaps: str = "/proc/self/smaps") -> list[tuple[int, int]]:
    """``(start, end)`` of each executable mapping of a library named in ``names`` that holds no private page
    (nothing written into it: every page is the file's)."""
    try:
        text = Path(smaps).read_text()
    except OSError:
        return []
    found, current = [], None
    for line in text.splitlines():
        m = _RANGE.match(line)
        if m:
            current = None
            if m[3] == "r-xp" and Path(m[4]).name in names:
                current = (int(m[1], 16), int(m[2], 16))
        elif current is not None and line.startswith(("Private_Dirty:", "Anonymous:")):
            if int(line.split()[1]) != 0:
                current = None          # a written page: not the file's, never dropped
            elif line.startswith("Anonymous:"):
                found.append(current)
                current = None
    return found


def drop_library_text(names: tuple[str, ...] = LIBRARIES) -> int:
    """Unmap the pages of torch's executable mappings (see the module doc); the bytes of address range given
    back (0 where nothing could be)."""
    libc = _libc()
    if libc is None:
        return 0
    dropped = 0
    for start, end in text_mappings(names):
        if libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
            dropped += end - start
    return dropped


def small_pages(base: int, size: int) -> bool:
    """Map the mapping at ``base`` with small pages only (``MADV_NOHUGEPAGE``), before anything is read through
    it: a page-cache folio of 2 MB is otherwise mapped by one huge entry, and :func:`map_only` could not unmap
    part of it. True when the kernel took the advice."""
    libc = _libc()
    return libc is not None and libc.madvise(base, size, _MADV_NOHUGEPAGE) == 0


def map_only(base: int, size: int, used: list[tuple[int, int]]) -> int:
    """Of the private file mapping at ``base`` (``size`` bytes, page-aligned), keep mapped only the byte ranges
    ``used`` (``(start, end)`` addresses inside it). For a file read once into copies (a GGUF's header, its q/k
    rows reordered into a copy, its norms widened to fp32) and otherwise served as views: the used ranges are
    mapped in now, a byte of every page read, so no later page fault maps a whole folio across a gap; then the
    pages wholly outside them are unmapped (clean file pages: read again if ever touched). The mapping must be
    :func:`small_pages` from the start; without that nothing is unmapped. Returns the bytes unmapped."""
    libc = _libc()
    if libc is None or not small_pages(base, size):
        return 0
    merged: list[list[int]] = []
    for lo, hi in sorted(used):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    for lo, hi in merged:
        start = lo // _PAGE * _PAGE
        pages = np.ctypeslib.as_array(ctypes.cast(start, ctypes.POINTER(ctypes.c_uint8)), shape=(hi - start,))
        int(pages[::_PAGE].sum())
    dropped, cursor = 0, base
    for lo, hi in [*merged, [base + size, base + size]]:
        start, end = -(-cursor // _PAGE) * _PAGE, lo // _PAGE * _PAGE     # the gap's whole pages only
        if end > start and libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
            dropped += end - start
        cursor = max(cursor, hi)
    return dropped


def settle() -> None:
    """After a CPU model is loaded: :func:`drop_library_text`, then :func:`trim_heap`."""
    drop_library_text()
    trim_heap()
