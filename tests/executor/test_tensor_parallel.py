"""Tensor parallelism on the CPU: rank 0 here, rank 1 in a spawned worker process, reducing
through the shared-memory communicator. The oracle is the same engine at size 1."""

import os
import signal
import threading
import time

import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.config import Config
from pyserve.engine.core import EngineCore
from tests.executor.ranks import alive, assert_same_step, segments_of

PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 200, 300], list(range(3, 60)), [7] * 20]


def greedy(llm, prompts=PROMPTS, max_tokens=24, **extra):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


# llama: 4 heads, 2 KV heads (one per rank); qwen2: 4 heads, 1 KV head (replicated on both
# ranks), tied embeddings and qkv bias
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_and_logprobs_at_tp2_equal_tp1(tiny_model_factory, arch):
    model = str(tiny_model_factory(arch))
    results = {}
    for tp in (1, 2):
        llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory=1 << 22)
        try:
            results[tp] = greedy(llm, logprobs=3, prompt_logprobs=2)
        finally:
            llm.shutdown()
    for one, two in zip(results[1], results[2]):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
            assert a.keys() == b.keys()


def _engine(model: str, tp: int, blocks: int) -> EngineCore:
    # the tiny llama's block holds 2 layers x K,V x (2 / tp) KV heads x 16 dims x 16 tokens x 4 B
    per_block = 2 * 2 * (2 // tp) * 16 * 16 * 4
    return EngineCore(Config.from_flat(model=model, tensor_parallel_size=tp, max_model_len=128,
                                       kv_cache_memory=blocks * per_block, max_num_batched_tokens=64))


def _drive(core: EngineCore, abort_after: int | None) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == abort_after:
            core.abort("r1")
    return tokens


def test_abort_and_preemption_at_tp2_match_tp1(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    runs = {}
    for tp in (1, 2):
        core = _engine(model, tp, blocks=12)  # four requests need 16 blocks: some are preempted
        try:
            runs[tp] = (_drive(core, abort_after=6), core.scheduler.num_preemptions,
                        core.kv.num_free_blocks, core.kv.num_blocks)
        finally:
            core.shutdown()
    tokens1, preempted1, free1, total1 = runs[1]
    tokens2, preempted2, free2, total2 = runs[2]
    assert preempted2 > 0 and preempted1 == preempted2
    assert tokens1 == tokens2
    assert len(tokens2["r0"]) == 40 and len(tokens2.get("r1", [])) < 40  # r1 was aborted
    assert free2 == total2 and free1 == total1  # nothing leaked, aborted request included


def test_shutdown_leaves_no_worker_and_no_shared_memory(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), tensor_parallel_size=2, kv_cache_memory=1 << 22)
    workers = llm.engine.executor.rank_pids[1:]
    assert len(workers) == 1 and alive(workers[0])
    assert segments_of(os.getpid()) == []  # unlinked as soon as both ranks attached
    greedy(llm, max_tokens=4)
    llm.shutdown()
    assert not alive(workers[0])
    assert segments_of(os.getpid()) == []


def test_worker_death_is_reported_within_a_second_and_fails_the_next_step(tiny_model_factory):
    core = _engine(str(tiny_model_factory("llama")), 2, blocks=64)
    reported = threading.Event()
    reasons = []
    core.on_executor_failure(lambda reason: (reasons.append(reason), reported.set()))
    worker = core.executor.rank_pids[1]
    try:
        core.add_request("r", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
        core.step()
        start = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        assert reported.wait(1.0), "worker death not reported within a second"
        assert time.monotonic() - start < 1.0
        assert "rank1" in reasons[0] and str(worker) in reasons[0]
        with pytest.raises(RuntimeError, match="exited"):
            core.step()
    finally:
        core.shutdown()


def test_step_channel_round_trip():
    import secrets

    from pyserve import _native
    from pyserve.executor.step_channel import StepChannel
    from pyserve.model.layers.attention import AttentionMetadata
    from pyserve.model.runner import ForwardInputs

    name = f"/pyserve-test-{os.getpid()}-{secrets.token_hex(4)}"
    sender = StepChannel(_native.ShmCommunicator(name, 0, 2, 1024, create=True))
    receiver = StepChannel(_native.ShmCommunicator(name, 1, 2, 1024, create=False))
    sent = ForwardInputs(torch.arange(300), torch.arange(300) + 7,
                         AttentionMetadata(torch.arange(300) * 3, torch.arange(12, dtype=torch.int32).view(3, 4),
                                           torch.tensor([0, 100, 200, 300], dtype=torch.int32),
                                           torch.tensor([100, 150, 120], dtype=torch.int32)),
                         torch.tensor([99, 199, 299]))
    # the hybrid KV layout: three groups' slots and tables
    slots = torch.arange(900).view(3, 300) * 5
    tables = torch.arange(36, dtype=torch.int32).view(3, 3, 4)
    grouped = ForwardInputs(sent.input_ids, sent.positions,
                            AttentionMetadata(slots[0], tables[0], sent.meta.query_start_loc,
                                              sent.meta.seq_lens, slots, tables), sent.logits_rows)
    for step in (sent, grouped):
        got = []
        t = threading.Thread(target=lambda: got.append(receiver.receive()))
        t.start()
        sender.send(step)
        t.join(5)
        (received,) = got
        assert_same_step(step, received)


def test_speculative_decoding_at_tp2_equals_plain_decoding(tiny_model_factory):
    """Every rank runs the verify rows' logits collective; rank 0 verifies."""
    model = str(tiny_model_factory("llama"))
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], [1, 7, 8, 7, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model, kv_cache_memory=1 << 22)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    spec = LLM(model, tensor_parallel_size=2, kv_cache_memory=1 << 22,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1})
    try:
        got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert spec.engine.stats.spec_drafts > 0
    finally:
        spec.shutdown()
    assert got == want
