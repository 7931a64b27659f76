"""pyserve/server/malloc_trim.py: malloc_trim(0) every few seconds hands the free pages inside
glibc's arenas back to the kernel (issue 20: RssAnon crept up with traffic as each step's
tensors touched new pages of the model thread's mostly free arena)."""

import asyncio
import ctypes
import sys

import pytest

from pyserve.server.malloc_trim import MallocTrimmer


def rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon")


def test_the_trimmer_trims_every_interval_until_stopped():
    calls = []

    async def main():
        trimmer = MallocTrimmer(interval_s=0.01, trim=calls.append)
        task = trimmer.start()
        assert trimmer.start() is task  # one task, however often started
        await asyncio.sleep(0.2)
        trimmer.stop()
        await asyncio.sleep(0)
        assert task.cancelled()
        n = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == n and n >= 3 and set(calls) == {0}
        assert trimmer.trims == n

    asyncio.run(main())


def test_a_failing_trim_stops_trimming_not_the_server():
    def broken(pad):
        raise OSError("no")

    async def main():
        trimmer = MallocTrimmer(interval_s=0.01, trim=broken)
        task = trimmer.start()
        await asyncio.wait_for(task, 1.0)  # it ends by itself
        assert task.exception() is None

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trimming_returns_the_free_middle_of_a_heap():
    """Free chunks below a live one stay resident after free(); malloc_trim releases them."""
    trimmer = MallocTrimmer()
    if not trimmer.available:
        pytest.skip("no malloc_trim in this C library")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunk = 64 * 1024  # under glibc's mmap threshold: from the arena, as a step's tensors are
    blocks = [libc.malloc(chunk) for _ in range(1600)]  # 100 MiB
    pin = libc.malloc(chunk)  # above them: the heap's top cannot shrink past it
    for block in blocks:
        ctypes.memset(block, 1, chunk)
    try:
        for block in blocks:
            libc.free(block)
        freed = rss_anon_kib()
        trimmer.trim_now()
        trimmed = rss_anon_kib()
    finally:
        libc.free(pin)
    assert freed - trimmed > 50 * 1024, (freed, trimmed)
    assert trimmer.trims == 1
