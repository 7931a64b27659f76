"""glibc's malloc, told to keep the memory a step frees for the next step.

A step that runs through torch's own ops (the BERT-family encoder's, a prefill's Python
layers) allocates fresh tensors of several MiB a layer and frees them by the step's end. On
the model thread, which allocates from one of glibc's per-thread arenas, malloc gives the
freed top of that arena back to the kernel (a heap is shrunk once its free top exceeds
M_TRIM_THRESHOLD), and the next step faults every page in again, zero-filled: 945,000 page
faults and 1.6 s of system time in 1,000 MiniLM-shaped embeddings (5.2 s), none after this
(python -m benchmarks.embeddings --skip-decoder, taking turns: 189.7 and 180.5 embeddings/s
before, 225.6 and 211.9 after). glibc's own remedy, the mmap threshold that rises with each
freed mapping, stops at 32 MiB and works only while no threshold has been set; setting the
trim threshold alone (as the MALLOC_TRIM_THRESHOLD_ variable does) freezes the mmap
threshold at 128 KiB and made it worse (2.5 million faults). So: allocations up to 32 MiB
(glibc's ceiling for the threshold) come from the arenas, an arena keeps up to
KEEP_FREE_BYTES of free top, and a top pad of a whole thread heap (64 MiB) keeps glibc from
unmapping a thread arena's emptied extra heaps (it does so regardless of the trim
threshold unless the pad asks for that much).

The cost is resident memory: a process holds on to its largest step's transient tensors
(the peak is the same). The server's periodic malloc_trim (server/malloc_trim.py) still hands
free pages back every 10 s, so an idle server's RSS falls as before; the step after a trim
faults its memory in once. It is a process-wide setting, applied by the process that runs a
model (rank 0's and each worker's), and skipped where the user chose an allocator: any
MALLOC_* or glibc.malloc tunable in the environment, or a preloaded tcmalloc / jemalloc
(vLLM's CPU guide preloads tcmalloc)."""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("pyserve")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit
KEEP_FREE_BYTES = 1 << 30
HEAP_BYTES = 64 << 20  # a thread arena's heap: glibc's HEAP_MAX_SIZE on 64-bit

_USER_CHOICES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                 "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_chose_allocator(environ: dict[str, str] = os.environ) -> bool:
    """The environment already says how malloc should behave (see the module's docstring)."""
    if any(name in environ for name in _USER_CHOICES):
        return True
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return True
    preload = environ.get("LD_PRELOAD", "")
    return "tcmalloc" in preload or "jemalloc" in preload


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds as the docstring explains; True where they were set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or user_chose_allocator():
        return False
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, KEEP_FREE_BYTES),
        (M_TOP_PAD, HEAP_BYTES)))
    if not ok:
        logger.warning("glibc refused the malloc thresholds; steps may fault their memory in again")
    return ok
