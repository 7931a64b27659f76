"""Only the model thread opens OpenMP teams: a thread that runs its parallel regions serially
makes no team of its own, so libgomp keeps spinning (not sleeping) at the model's barriers.
Run in a child process: OpenMP's teams live as long as the process."""

import subprocess
import sys
import textwrap

import torch

from pyserve import _native

CHILD = textwrap.dedent("""
    import os, threading, time, torch
    from pyserve import _native
    from pyserve.executor.threads import run_parallel_regions_serially, serial_thread_pool

    torch.set_num_threads(2)
    big = torch.arange(1 << 20)

    def threads():  # after a pause: a thread just joined may still be leaving the process
        time.sleep(0.3)
        return len(os.listdir("/proc/self/task"))

    def region():  # a parallel region of at least two threads where the thread may open one
        torch.repeat_interleave(torch.arange(1 << 16), torch.full((1 << 16,), 2)).sum()

    region()  # the main thread's team
    def on_thread(serial):
        out = {}
        def run():
            if serial:
                run_parallel_regions_serially()
            before = threads()
            region()
            # the extension's own first parallel region on this thread must keep the limit too
            rows = torch.randn(4096, 512)
            _native.rms_norm(torch.empty_like(rows), rows, torch.ones(512), 1e-6)
            out["threads_here"] = torch.get_num_threads()
            out["new_threads"] = threads() - before
        t = threading.Thread(target=run)
        t.start(); t.join()
        return out
    serial = on_thread(True)
    pooled = serial_thread_pool(1, "t").submit(lambda: (torch.get_num_threads(), threads(), region(), threads())).result()
    plain = on_thread(False)
    print(serial["threads_here"], serial["new_threads"], pooled[0], pooled[3] - pooled[1],
          plain["threads_here"], plain["new_threads"], torch.get_num_threads())
""")


def test_a_serial_thread_opens_no_team_and_others_keep_theirs():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    here, new, pooled_here, pooled_new, plain_here, plain_new, main_here = map(int, out.stdout.split())
    assert (here, new) == (1, 0)  # serial: its region ran on it alone, no worker made
    assert (pooled_here, pooled_new) == (1, 0)  # the same for a serial pool's thread
    assert plain_here == 2 and plain_new >= 1  # the check can fail: a plain thread makes a team
    assert main_here == 2  # the process's (the model thread's) count is untouched


def test_the_limit_returns_the_count_it_replaced():
    before = _native.limit_parallel_regions(1)
    try:
        assert torch.get_num_threads() == 1
    finally:
        assert _native.limit_parallel_regions(before) == 1
    assert torch.get_num_threads() == before
