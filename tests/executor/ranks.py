"""What the multi-rank tests share: a process's liveness, its shared-memory segments, and
the comparisons of two runs' outputs and of a step as sent and as received."""

import os

import pytest
import torch


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"pyserve-tp-{pid}-")]


def assert_split_equals_one_rank(path, prompts: list[str], **split_flags) -> None:
    """The model at path split over ranks (split_flags: tensor_parallel_size=2, ...) gives the
    greedy ids and logprobs it gives on one rank (assert_same_greedy)."""
    from pyserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    want = LLM(str(path)).generate(prompts, params)
    split = LLM(str(path), **split_flags)
    try:
        assert_same_greedy(want, split.generate(prompts, params))
    finally:
        split.shutdown()


def assert_same_greedy(want, got) -> None:
    """The same greedy ids, and the same sampled logprobs (to 1e-4), request by request."""
    for one, two in zip(want, got, strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs or [], two.outputs[0].logprobs or []):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def assert_same_step(sent, received) -> None:
    """A step's ForwardInputs arrived as sent: every array equal, dtypes included."""
    for a, b in [(sent.input_ids, received.input_ids), (sent.positions, received.positions),
                 (sent.logits_rows, received.logits_rows)]:
        assert torch.equal(a, b)
    for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
        a, b = getattr(sent.meta, name), getattr(received.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b)
    for name in ("group_slot_mapping", "group_block_tables"):
        a, b = getattr(sent.meta, name), getattr(received.meta, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)
