"""Memory for columns of millions of rows: cheap page faults, freed arrays reused, big ones mapped up front.

Analysing a 16,384-rank job allocates and frees numpy arrays of ~100 MB hundreds of times, and every fresh page is
faulted in. On the 2-core development machine (a virtual machine with transparent huge pages in ``madvise`` mode
and ``defrag`` ``madvise``, where huge pages are seldom available) that cost more than the numbers themselves:
numpy advises the kernel to back every big array with huge pages (``MADV_HUGEPAGE``), so each fault first tries to
compact memory for a huge page, fails, and falls back to a small one. ``meshscope analyze`` spent 6–7 s of system
time that way, against ~9 s of user time in the same process (``benchmarks/bench_analyze_jsonl.py``). Remedies,
all Linux-only and harmless elsewhere:

- :func:`tune_memory_for_columns` (for a command's process, once at start): no huge-page advice from numpy (what
  ``NUMPY_MADVISE_HUGEPAGE=0`` does at numpy's import), and glibc's ``malloc`` serves blocks up to 1 GiB from its
  heap and keeps freed memory for the next array instead of returning it to the kernel. Together: system time of
  the analysing process 6–7 s -> ~1.4 s. The price: the process keeps its peak memory until it exits, which a
  short command does anyway; where huge pages are plentiful a few per cent of speed may be lost.
- :func:`mapped_empty`: an uninitialised array whose pages are mapped in one system call (``MAP_POPULATE``) instead
  of one fault per 4 KiB page, for a big array that is about to be written whole (the merged columns of a read):
  0.7 GiB in ~0.2 s of system time instead of 0.4–1.6 s.

This module must not change anything at import time, and must never fail: where the platform lacks a facility, it
does nothing and the program runs as it would without it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    from numpy._core import multiarray as np_multiarray
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as np_multiarray  # type: ignore[no-redef]

if TYPE_CHECKING:
    from numpy.typing import NDArray

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc ``malloc.h``)."""
_KEEP_BYTES = 1 << 30
"""Blocks up to this size come from the heap; freed memory up to ~this much stays in the process."""
_POPULATE_MIN_BYTES = 1 << 24
"""Smaller arrays are allocated as usual: the saving is in the page faults of big ones."""


def tune_memory_for_columns() -> bool:
    """Cheap page faults and reused memory for the rest of this process (see the module docstring).

    Process-wide and for the life of the process: call it once, at the start of a command that analyses big inputs
    (``meshscope analyze``, ``report``, ``simulate``), never from library code.

    Returns:
        Whether glibc's ``malloc`` took the settings (``False`` off Linux or with another C library, e.g. musl).
    """
    advise = getattr(np_multiarray, "_set_madvise_hugepage", None)  # what numpy's import does with that variable
    if advise is not None:
        advise(False)  # noqa: FBT003 - numpy's own positional switch
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # A trim threshold of -1 reads as the largest size: the heap's free top is never given back.
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))


def mapped_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> NDArray[Any]:
    """``np.empty(shape, dtype)``, with the pages of a big array mapped up front in one call where Linux allows.

    The array owns its mapping (it is unmapped when the array and its views are gone).
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes < _POPULATE_MIN_BYTES or not populate:
        return np.empty(shape, dtype=dtype)
    try:
        block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    except OSError:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(block, dtype=dtype).reshape(shape)
