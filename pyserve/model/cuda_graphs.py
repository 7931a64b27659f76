"""Decode steps replayed from CUDA graphs.

A decode-only batch (one new token per sequence) of n sequences runs as the graph of the
smallest captured batch size b >= n: the step's inputs are copied into static buffers, rows
n..b-1 are padding (slot -1, so nothing is written to the KV cache; a one-token context, read
and discarded), and the graph replays the whole forward, embedding to final norm, in one
launch. Logits are computed outside the graph, from the first n rows. Mixed or larger batches
run eagerly. Block tables are as wide as --max-model-len needs, so the attention kernel's
split count, which it takes from that width, never changes between capture and replay.

The graphs themselves, their memory pool and capture stream belong to the extension
(pyserve._C.CudaGraphs); `backend` is anything with its capture/replay/has interface, which
lets the padding and buffer logic here run on the CPU in tests (EagerReplay)."""

from __future__ import annotations

import logging
import time

import torch

from pyserve.model.layers.attention import AttentionMetadata

logger = logging.getLogger("pyserve")

MAX_CAPTURE_SIZE = 512


def capture_sizes(requested: tuple[int, ...] | None, max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's --cuda-graph-sizes: none given -> 1, 2, 4, then every multiple of 8; one value N
    -> that pattern up to N; several -> exactly those. Capped at --max-num-seqs (and 512)."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    if requested is None or len(requested) == 1:
        top = limit if requested is None else min(requested[0], limit)
        sizes = [s for s in (1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)) if s <= top]
        if top not in sizes:
            sizes.append(top)  # the largest decode batch must have a graph
    else:
        sizes = [s for s in requested if 0 < s <= limit]
    return tuple(sorted(set(sizes)))


class EagerReplay:
    """The CudaGraphs interface run eagerly: 'replaying' calls the recorded forward again."""

    def __init__(self):
        self._forwards = {}

    def capture(self, size: int, forward) -> None:
        forward()
        self._forwards[size] = forward

    def replay(self, size: int) -> None:
        self._forwards[size]()

    def has(self, size: int) -> bool:
        return size in self._forwards


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches, sizes: tuple[int, ...], max_blocks_per_seq: int,
                 device: torch.device, backend):
        self.model, self.kv_caches, self.device, self.backend = model, kv_caches, device, backend
        self.sizes = tuple(sorted(sizes))
        top = self.sizes[-1]
        on = dict(device=device)
        self.input_ids = torch.zeros(top, dtype=torch.int64, **on)
        self.positions = torch.zeros(top, dtype=torch.int64, **on)
        # every KV group's slots and tables (the hybrid layout, kv/groups.py); one group: [0]
        self.num_groups = 1 + max((getattr(c, "group", 0) for c in kv_caches), default=0)
        self.group_slots = torch.full((self.num_groups, top), -1, dtype=torch.int64, **on)
        self.group_tables = torch.zeros(self.num_groups, top, max_blocks_per_seq, dtype=torch.int32, **on)
        self.slot_mapping, self.block_tables = self.group_slots[0], self.group_tables[0]
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, **on)  # one token each
        self.seq_lens = torch.ones(top, dtype=torch.int32, **on)
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, size: int) -> None:
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size],
                                 self.query_start_loc[:size + 1], self.seq_lens[:size])
        if self.num_groups > 1:
            meta.group_slot_mapping = self.group_slots[:, :size]
            meta.group_block_tables = self.group_tables[:, :size]
        self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Captures every size, largest first (the smaller ones reuse its pool); -> seconds."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self.backend.capture(size, lambda size=size: self._forward(size))
        return time.perf_counter() - start

    def bucket(self, inputs) -> int | None:
        """The graph size for this step, or None when it must run eagerly."""
        n = inputs.input_ids.numel()
        meta = inputs.meta
        if n == 0 or n > self.sizes[-1] or meta.seq_lens.numel() != n:
            return None  # not decode-only (a prompt chunk has several tokens), or too large
        if meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        return next(s for s in self.sizes if s >= n)

    def run(self, inputs, size: int) -> torch.Tensor:
        """inputs: host ForwardInputs of a decode-only batch -> hidden states [n, hidden]."""
        n = inputs.input_ids.numel()
        meta = inputs.meta
        width = meta.block_tables.shape[1]
        copy = lambda dst, src: dst.copy_(src, non_blocking=True)
        copy(self.input_ids[:n], inputs.input_ids)
        copy(self.positions[:n], inputs.positions)
        copy(self.seq_lens[:n], meta.seq_lens)
        self.group_tables[:, :n, width:].zero_()
        if meta.group_block_tables is None:
            copy(self.slot_mapping[:n], meta.slot_mapping)
            copy(self.block_tables[:n, :width], meta.block_tables)
        else:
            copy(self.group_slots[:, :n], meta.group_slot_mapping)
            copy(self.group_tables[:, :n, :width], meta.group_block_tables)
        if size > n:  # padding rows: no KV write, a one-token context at block 0
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.group_slots[:, n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.group_tables[:, n:size].zero_()
        self.backend.replay(size)
        return self.outputs[size][:n]


def capture_decode_graphs(model, kv_caches, sizes: tuple[int, ...], max_blocks_per_seq: int,
                          device: torch.device, backend=None) -> DecodeGraphs:
    """Captures the decode graphs on a CUDA device (backend: pyserve._C.CudaGraphs) and logs
    the time and the graph pool's memory."""
    from pyserve import _native

    if backend is None:
        backend = _native.CudaGraphs(device.index or 0)
    graphs = DecodeGraphs(model, kv_caches, sizes, max_blocks_per_seq, device, backend)
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    seconds = graphs.capture_all()
    pool = (torch.cuda.memory_reserved(device) - before) if device.type == "cuda" else 0
    logger.info("CUDA graphs: captured %d decode batch sizes (%s) in %.2fs; graph memory %.2f GiB",
                len(sizes), ", ".join(map(str, sizes)), seconds, pool / 1024**3)
    return graphs
