"""The model thread alone runs parallel regions (torch's and the extension's OpenMP teams).

libgomp keeps one team of worker threads per thread that opens a parallel region, and its
workers spin at a region's barrier only while it manages no more threads than the machine
has CPUs. A second team, made once by a large enough index op on the event loop (a step's
inputs are prepared there), turns that off for the life of the process: from then on each of
the model's few hundred regions a step puts its workers to sleep and wakes them through the
kernel (Gemma 3's W2 lost 11-28 % of its throughput so). So every other thread that touches
tensors runs its regions serially.

MKL's own thread count is not limited here: once torch.set_num_threads has run (tensor
parallelism sets it), a large torch.mm on a limited thread would still open a team. No thread
but the model's multiplies matrices.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pyserve import _native


def run_parallel_regions_serially() -> None:
    """The calling thread's parallel regions run on it alone from now on; torch's thread
    count for the process (and the model thread's) stays as configured."""
    _native.limit_parallel_regions(1)


def serial_thread_pool(max_workers: int | None, name: str) -> ThreadPoolExecutor:
    """A thread pool for work beside the model (grammars, request parsing) whose threads
    open no OpenMP team of their own."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=run_parallel_regions_serially)
