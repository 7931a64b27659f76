"""How much of a CPU tensor's memory is resident: the pages the process has written, which
mincore(2) reports. A KV pool is allocated once and left unwritten (kv/cache.py), so its
resident share is the memory its blocks have taken so far, what a soak subtracts from the
process's RSS to tell a leak from the pool filling."""

from __future__ import annotations

import ctypes
import mmap

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_libc.mincore.restype = ctypes.c_int


def resident_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of the tensor's whole storage that are resident (whole pages, so up to a page
    more at either end); None for a tensor not in host memory."""
    if tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return 0
    page = mmap.PAGESIZE
    start = storage.data_ptr() // page * page
    length = storage.data_ptr() + storage.nbytes() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on a tensor's storage")
    flags = torch.frombuffer(vec, dtype=torch.uint8)
    return int(flags.bitwise_and(1).sum()) * page
