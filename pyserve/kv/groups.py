"""Which layers share a KV block: vLLM's hybrid KV-cache layout, for models that mix global
and sliding-window layers (Gemma 2 and 3, Qwen2 with max_window_layers) or slide everywhere
(Mistral).

A sliding layer never reads keys older than its window, so its blocks can go back to the pool
once they fall out of a sequence's window, while a global layer needs every block. Layers are
cut into groups of equal size, each group of one attention kind, and each group gets its own
block table per request: one block id stands for group_size layers' pages (slot j of block b
is layer j of whichever group b was given to), so every group draws from the one pool and a
block freed by a sliding group can serve a global one. Gemma 3's 5 : 1 pattern makes one global
group and five sliding ones; past the window a sequence's sliding groups hold only the window's
blocks (plus the step's chunk), so a long context costs about a sixth of the KV memory.

A table entry whose block fell out of the window holds null_block: an extra block past the
pool's, zeroed and never written, so a kernel that reads a masked key from it reads zeros.

With one group (no sliding layers, --disable-hybrid-kv-cache-manager, a context that never
outgrows the window) the layout is the plain one: one table, every layer in every block."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyserve.arith import cdiv

# more groups than this and the per-request tables cost more than the memory is worth
MAX_GROUPS = 8


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, None for global
    layers: tuple[tuple[int, ...], ...]  # per group, its layers in slot order

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers one block holds: the largest group's (a shorter group leaves slots unused)."""
        return max(len(g) for g in self.layers)

    @property
    def frees_windows(self) -> bool:
        """Some group slides: its out-of-window blocks are freed, and tables hold null_block."""
        return any(w is not None for w in self.windows)

    def place(self, layer: int) -> tuple[int, int]:
        """The layer's (group, slot)."""
        for g, layers in enumerate(self.layers):
            if layer in layers:
                return g, layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV group")

    def window_start(self, group: int, position: int, block_size: int) -> int:
        """The first block of the group that a query at `position` still reads: blocks before
        it hold only keys at or below position - window, out of every later query's window."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, (position - window + 1) // block_size)

    def blocks_for_sequence(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks one sequence of num_tokens holds at most: every block in a global group, in a
        sliding group the window's plus a step's chunk of up to `chunk` tokens."""
        total = 0
        for window in self.windows:
            tokens = num_tokens if window is None else min(num_tokens, window + chunk)
            total += cdiv(tokens, block_size) + (0 if window is None or tokens == num_tokens else 1)
        return total


def sequence_blocks(groups: KVGroups | None, num_tokens: int, block_size: int, chunk: int) -> int:
    """Blocks one sequence of num_tokens holds at most, under groups (None: the plain layout,
    one block per block_size tokens); chunk: --max-num-batched-tokens."""
    if groups is None:
        return cdiv(num_tokens, block_size)
    return groups.blocks_for_sequence(num_tokens, block_size, chunk)


def single_group(num_layers: int) -> KVGroups:
    return KVGroups((None,), (tuple(range(num_layers)),))


def plan_kv_groups(layer_windows: Sequence[int | None], max_model_len: int,
                   enabled: bool = True) -> KVGroups:
    """The groups for layers with these windows (None: global). One plain group when disabled,
    when no window is shorter than max_model_len (nothing would ever be freed) or when the
    layer kinds split into more than MAX_GROUPS groups."""
    n = len(layer_windows)
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window if window is not None and window < max_model_len else None,
                         []).append(layer)
    if not enabled or n == 0 or set(kinds) == {None}:
        return single_group(n)
    if len(kinds) == 1:  # every layer slides by the same window (Mistral)
        (window,) = kinds
        return KVGroups((window,), (tuple(range(n)),))
    size = min(len(layers) for layers in kinds.values())
    windows, groups = [], []
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):  # global first
        layers = kinds[window]
        for i in range(0, len(layers), size):
            windows.append(window)
            groups.append(tuple(layers[i:i + size]))
    if len(groups) > MAX_GROUPS:
        return single_group(n)
    return KVGroups(tuple(windows), tuple(groups))
