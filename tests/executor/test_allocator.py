"""keep_freed_memory: a model thread's freed step memory is reused without faulting it in
again (executor/allocator.py), and a user's own allocator choice is left alone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from pyserve.executor.allocator import user_chose_allocator

# In a fresh process (the setting is process-wide): a thread runs four "steps", each holding
# six blocks of 8 MiB at once (written) and then freeing them, as a layer's tensors are, and
# counts its own page faults in each.
PROBE = """
import ctypes, json, resource, sys, threading
from pyserve.executor.allocator import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
tuned = keep_freed_memory() if sys.argv[1] == "tuned" else False
faults = []
def steps():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(8 << 20) for _ in range(6)]
        for p in blocks:
            libc.memset(p, 1, 8 << 20)
        for p in blocks:
            libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=steps)
t.start()
t.join()
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


def probe(mode: str, env: dict[str, str] | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **(env or {})},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _huge_pages_always() -> bool:
    try:
        return "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc only")
@pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages always: faults count 2 MiB pages")
def test_freed_memory_is_reused_without_faults():
    pages = (48 << 20) // os.sysconf("SC_PAGE_SIZE")
    plain = probe("plain")
    # glibc's own thresholds: the first step's blocks are mapped and unmapped one by one, the
    # later ones come from the thread's arena, whose free top is given back at each step's end
    assert not plain["tuned"] and all(f >= pages // 2 for f in plain["faults"]), plain
    tuned = probe("tuned")
    assert tuned["tuned"] and tuned["faults"][0] >= pages // 2, tuned
    assert max(tuned["faults"][1:]) < pages // 20, tuned
    # a user's own choice of allocator wins: nothing is set
    left = probe("tuned", {"MALLOC_ARENA_MAX": "2"})
    assert not left["tuned"], left


@pytest.mark.parametrize("env,chose", [
    ({}, False),
    ({"PATH": "/usr/bin", "LD_PRELOAD": ""}, False),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, True),
    ({"MALLOC_ARENA_MAX": "4"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, True),
    ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1024"}, False),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}, True),
    ({"LD_PRELOAD": "libjemalloc.so.2"}, True),
    ({"LD_PRELOAD": "/opt/lib/libmimalloc.so"}, True),
    ({"MALLOC_CHECK_": "3"}, True),
])
def test_user_chose_allocator(env, chose):
    assert user_chose_allocator(env) is chose
