"""benchmarks/peers/servers.py's MemorySampler: RSS sampled while active, PSS read only when
paused or stopped (a PSS read walks the page tables under the process's memory-map lock, which
slowed the measured server), nothing read while paused."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.peers.servers import MemorySampler, tree_pss, tree_rss

MIB = 1024 * 1024
# a process that touches 64 MiB more each time it reads a line, and answers once it has
GROWER = ("import sys\nheld = []\nfor _ in sys.stdin:\n"
          "    held.append(bytearray(64 * 1024 * 1024))\n    print('ok', flush=True)\n")


def _grow(process) -> None:
    process.stdin.write("grow\n")
    process.stdin.flush()
    assert process.stdout.readline().strip() == "ok"


def _until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"),
                    reason="PSS needs Linux 4.14's smaps_rollup")
def test_rss_sampled_while_active_and_pss_only_at_pauses():
    process = subprocess.Popen([sys.executable, "-c", GROWER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    sampler = None
    try:
        sampler = MemorySampler(process.pid, interval_s=0.02)
        _grow(process)
        assert _until(lambda: sampler.peak_rss >= 64 * MIB)
        assert sampler.peak_pss == 0  # never read while sampling
        sampler.pause()
        paused_rss, paused_pss = sampler.peak_rss, sampler.peak_pss
        assert paused_pss >= 64 * MIB and paused_rss >= 64 * MIB
        _grow(process)  # 64 MiB more while paused: not seen
        time.sleep(0.2)
        assert (sampler.peak_rss, sampler.peak_pss) == (paused_rss, paused_pss)
        assert tree_rss(process.pid) >= paused_rss + 60 * MIB
        sampler.resume()
        assert _until(lambda: sampler.peak_rss >= paused_rss + 60 * MIB)
        _grow(process)
        sampler.stop()  # active: a last reading of both
        assert sampler.peak_pss >= paused_pss + 120 * MIB
        assert tree_pss(process.pid) >= sampler.peak_pss - 8 * MIB
    finally:
        if sampler is not None:
            sampler.stop()  # a second stop() does nothing; a failed test's thread ends here
        process.kill()
        process.wait()
