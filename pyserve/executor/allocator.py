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
for good (the peak is the same). The server's periodic malloc_trim (server/malloc_trim.py)
trims the main arena only, and a thread arena's top not at all, so up to a heap (64 MiB) per
thread arena stays resident: peak RSS under the peers harness read 1.11 GiB without this,
1.14 GiB with it. It is a process-wide setting, applied by the process that runs a model
(rank 0's and each worker's; also the user's own process under the offline LLM), and skipped
where the user chose an allocator, which is also how to opt out: any MALLOC_* variable or
glibc.malloc tunable in the environment (glibc's behaviour then is what those set), or a
preloaded allocator (vLLM's CPU guide preloads tcmalloc)."""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("pyserve")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for its own dynamic threshold on 64-bit
KEEP_FREE_BYTES = 1 << 30
HEAP_BYTES = 64 << 20  # a thread arena's heap: glibc's HEAP_MAX_SIZE on 64-bit



def user_chose_allocator(environ: dict[str, str] = os.environ) -> bool:
    """The environment already says how malloc should behave (see the module's docstring)."""
    if any(name.startswith("MALLOC_") for name in environ):
        return True
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return True
    preload = environ.get("LD_PRELOAD", "").lower()
    return "malloc" in preload or "hoard" in preload  # tcmalloc, jemalloc, mimalloc, ...


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
