"""Give the C heap that loading freed back to the operating system.

Parsing a checkpoint's side files leaves freed memory inside the process's malloc arenas: the ``tokenizers``
library's parse of the demo's 3.3 MB ``tokenizer.json`` peaks about 33 MB above the tokenizer it builds, and glibc
keeps those pages mapped (resident) for later allocations, which a serving process never makes at that size.
:func:`trim` asks glibc to return them (``malloc_trim``). Elsewhere (another C library, no ``libc.so.6``) it does
nothing: the memory is then merely kept, never wrong.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> bool:
    """Return the free pages of every malloc arena to the OS; True when glibc's ``malloc_trim`` ran."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
