"""The scheduler and the KV manager without a model, as vLLM's tests/v1/core/test_scheduler.py
drives its own: requests built by hand, each step's SchedulerOutput read, and the runner's part
played by the test (computed(), a token appended, finish). After every step the blocks add up:
free + held by live requests = the pool, and nothing stays behind once requests end."""

import pytest

from pyserve.config import SchedulerConfig
from pyserve.engine.request import Request, RequestStatus
from pyserve.engine.scheduler import Scheduler
from pyserve.kv.manager import KVCacheManager
from pyserve.sampling_params import SamplingParams

BLOCK = 4


def make(num_blocks=32, budget=8, max_seqs=8, caching=True, policy="fcfs"):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             scheduling_policy=policy)
    return Scheduler(config, kv), kv


_arrivals = iter(range(10**6))


def request(rid, prompt, max_tokens=4, priority=0, **params):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), (), max_tokens,
                   arrival=next(_arrivals), priority=priority)


def run_step(scheduler, requests, token=7):
    """Schedules one step and plays the runner: every sequence computed, every sampled one
    given `token`; a request at its max_tokens finishes. Returns the SchedulerOutput."""
    out = scheduler.schedule()
    for seq in out.sequences:
        r = requests[seq.request_id]
        assert seq.start == r.num_computed_tokens
        assert seq.token_ids == r.all_token_ids[seq.start: seq.start + seq.num_new_tokens]
        scheduler.computed(r, seq.num_new_tokens)
        if seq.sampling is not None:
            r.append_output(token)
            if len(r.output_token_ids) >= r.max_tokens:
                r.finish("length")
                scheduler.finish(r)
    return out


def blocks_add_up(scheduler, kv):
    held = {b for r in scheduler.running for b in kv.block_ids(r.request_id)}
    assert not any(kv.block_ids(r.request_id) for r in scheduler.waiting)  # waiting holds none
    # a block shared by running requests counts once; cached free blocks are free
    assert kv.num_free_blocks + len(held) == kv.num_blocks


def test_chunked_prefill_under_the_token_budget():
    scheduler, kv = make(budget=8)
    a = request("a", range(20), max_tokens=2)
    b = request("b", range(100, 103), max_tokens=2)
    reqs = {"a": a, "b": b}
    scheduler.add(a)
    scheduler.add(b)
    steps = []
    while scheduler.has_unfinished():
        out = run_step(scheduler, reqs)
        assert out.num_tokens <= 8
        steps.append([(s.request_id, s.num_new_tokens, s.sampling is not None) for s in out.sequences])
        blocks_add_up(scheduler, kv)
    # a's prompt in chunks of 8, 8, 4 (sampled only when the prompt is done); b fills the rest
    assert steps[0] == [("a", 8, False)]
    assert steps[1] == [("a", 8, False)]
    assert steps[2] == [("a", 4, True), ("b", 3, True)]
    assert steps[3] == [("a", 1, True), ("b", 1, True)]
    assert kv.num_free_blocks == kv.num_blocks and kv.num_tracked_requests() == 0


def test_running_requests_go_first_and_max_num_seqs_caps_admission():
    scheduler, kv = make(budget=64, max_seqs=2)
    reqs = {f"r{i}": request(f"r{i}", range(i * 10, i * 10 + 5), max_tokens=3) for i in range(3)}
    for r in reqs.values():
        scheduler.add(r)
    first = run_step(scheduler, reqs)
    assert [s.request_id for s in first.sequences] == ["r0", "r1"]
    second = run_step(scheduler, reqs)
    assert [s.request_id for s in second.sequences] == ["r0", "r1"]  # r2 waits for a slot
    while scheduler.has_unfinished():
        run_step(scheduler, reqs)
        blocks_add_up(scheduler, kv)
    assert all(r.finished for r in reqs.values())


def test_preemption_takes_the_latest_arrival_and_recomputes_it():
    # 6 blocks of 4: two 8-token prompts take 2 blocks each, then decodes need more
    scheduler, kv = make(num_blocks=6, budget=64, caching=False)
    a = request("a", range(8), max_tokens=8)
    b = request("b", range(50, 58), max_tokens=8)
    reqs = {"a": a, "b": b}
    scheduler.add(a)
    scheduler.add(b)
    preempted_at = None
    for step in range(40):
        if not scheduler.has_unfinished():
            break
        out = run_step(scheduler, reqs)
        blocks_add_up(scheduler, kv)
        if scheduler.num_preemptions and preempted_at is None:
            preempted_at = step
            assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
            assert b.num_preemptions == 1 and kv.block_ids("b") == []
            assert "b" not in [s.request_id for s in out.sequences]  # nothing admitted that step
    assert preempted_at is not None and a.num_preemptions == 0
    assert a.finished and b.finished and len(b.output_token_ids) == 8
    assert kv.num_free_blocks == kv.num_blocks


def test_preemption_under_priority_takes_the_lowest_priority():
    scheduler, kv = make(num_blocks=6, budget=64, caching=False, policy="priority")
    low = request("low", range(8), max_tokens=8, priority=5)
    high = request("high", range(50, 58), max_tokens=8, priority=0)
    reqs = {"low": low, "high": high}
    scheduler.add(low)
    scheduler.add(high)
    while not scheduler.num_preemptions:
        run_step(scheduler, reqs)
    assert low.num_preemptions == 1 and high.num_preemptions == 0


def test_a_cached_prefix_is_not_computed_again():
    scheduler, kv = make(budget=64)
    shared = list(range(12))  # three full blocks
    a = request("a", shared + [90, 91], max_tokens=5)
    reqs = {"a": a}
    scheduler.add(a)
    run_step(scheduler, reqs)  # a's prompt computed: its full blocks are cached
    b = request("b", shared + [95], max_tokens=2)
    reqs["b"] = b
    scheduler.add(b)
    out = run_step(scheduler, reqs)
    seq = next(s for s in out.sequences if s.request_id == "b")
    assert seq.start == 12 and seq.token_ids == [95] and b.num_cached_tokens == 12
    assert kv.block_ids("b")[:3] == kv.block_ids("a")[:3]
    assert all(kv.pool.ref_count(block) == 2 for block in kv.block_ids("a")[:3])
    assert kv.prefix_hits == 12
    blocks_add_up(scheduler, kv)


def test_a_waiter_defers_to_the_request_computing_its_prefix():
    scheduler, kv = make(budget=64)
    shared = list(range(12))
    a, b = request("a", shared + [1], max_tokens=1), request("b", shared + [2], max_tokens=1)
    reqs = {"a": a, "b": b}
    scheduler.add(a)
    scheduler.add(b)
    first = run_step(scheduler, reqs)
    assert [s.request_id for s in first.sequences] == ["a"]
    second = run_step(scheduler, reqs)
    assert [(s.request_id, s.start) for s in second.sequences] == [("b", 12)]


def test_prompt_logprobs_skip_the_cache_and_name_their_targets():
    scheduler, kv = make(budget=5)
    a = request("a", range(12), max_tokens=1)
    reqs = {"a": a}
    scheduler.add(a)
    run_step(scheduler, reqs)
    b = request("b", range(12), max_tokens=1, prompt_logprobs=2)
    reqs["b"] = b
    scheduler.add(b)
    chunks = []
    while not b.finished:
        out = run_step(scheduler, reqs)
        for s in out.sequences:
            if s.request_id == "b":
                chunks.append((s.start, s.prompt_logprobs))
    assert chunks[0][0] == 0  # computed from the start, though a cached it
    targets = [t for _, lp in chunks if lp is not None for t in lp.targets]
    assert targets == list(range(1, 12))  # each prompt token after the first, scored once
    assert all(lp.first_position == start + 1 for start, lp in chunks if lp is not None)
    assert len(chunks) > 1  # the prompt came in chunks


@pytest.mark.parametrize("state", ["waiting", "running", "preempted", "finished"])
def test_abort_in_every_state_frees_everything(state):
    scheduler, kv = make(num_blocks=6, budget=64, caching=False)
    a = request("a", range(8), max_tokens=8)
    b = request("b", range(50, 58), max_tokens=8 if state != "finished" else 1)
    reqs = {"a": a, "b": b}
    scheduler.add(a)
    scheduler.add(b)
    if state == "running":
        run_step(scheduler, reqs)
        assert b.status is RequestStatus.RUNNING
    elif state == "preempted":
        while not scheduler.num_preemptions:
            run_step(scheduler, reqs)
        assert b.status is RequestStatus.WAITING and b.num_preemptions == 1
    elif state == "finished":
        run_step(scheduler, reqs)
        assert b.finished
    if not b.finished:
        b.finish("abort")
        scheduler.finish(b)
    assert b not in scheduler.running and b not in scheduler.waiting
    assert kv.block_ids("b") == []
    blocks_add_up(scheduler, kv)
    a.finish("abort")
    scheduler.finish(a)
    assert kv.num_free_blocks == kv.num_blocks and kv.num_tracked_requests() == 0
    # the runner is told, with the next step that has sequences
    c = request("c", range(3), max_tokens=1)
    scheduler.add(c)
    out = scheduler.schedule()
    assert {"a", "b"} <= set(out.finished_request_ids)
    assert scheduler.schedule().finished_request_ids == []


def test_n_fan_out_shares_the_prompt_through_the_cache(tiny_model_factory):
    from pyserve.engine.admission import Admission, Limits
    from pyserve.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_factory("llama"))
    scheduler, kv = make(budget=64)
    admission = Admission(Limits(vocab_size=256, max_model_len=64, num_blocks=32, block_size=BLOCK,
                                 max_logprobs=5, priority_scheduling=False), (), tokenizer,
                          staged_siblings=True)
    group = admission.admit("g", list(range(10, 22)), SamplingParams(n=3, max_tokens=2, seed=4))
    assert [c.request_id for c in group.children] == ["g#0", "g#1", "g#2"]
    assert [c.params.seed for c in group.children] == [4, 5, 6]
    reqs = {c.request_id: c for c in group.children}
    scheduler.add(group.children[0])  # the siblings are pending until it computed the prompt
    first = run_step(scheduler, reqs)
    assert [s.request_id for s in first.sequences] == ["g#0"]
    released = group.release_pending()
    assert [c.request_id for c in released] == ["g#1", "g#2"]
    for sibling in released:
        scheduler.add(sibling)
    second = run_step(scheduler, reqs)
    starts = {s.request_id: s.start for s in second.sequences}
    assert starts["g#1"] == starts["g#2"] == 8  # two full blocks (the last token is computed)
    blocks_add_up(scheduler, kv)
    while scheduler.has_unfinished():
        run_step(scheduler, reqs)
    assert group.finished and kv.num_free_blocks == kv.num_blocks


def test_a_request_that_can_never_fit_is_refused_at_admission(tiny_model_factory):
    from pyserve.engine.admission import Admission, Limits
    from pyserve.errors import InvalidRequest
    from pyserve.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_factory("llama"))
    admission = Admission(Limits(256, 64, 4, BLOCK, 5, False), (), tokenizer, staged_siblings=True)
    with pytest.raises(InvalidRequest) as exc:  # 20 tokens need 5 blocks of 4; the pool has 4
        admission.admit("x", list(range(10)), SamplingParams(max_tokens=10))
    assert exc.value.param is None and "KV cache" in exc.value.message
    for params, field in ((SamplingParams(max_tokens=60), "max_tokens"),
                          (SamplingParams(max_tokens=2, logprobs=6), "logprobs"),
                          (SamplingParams(max_tokens=2, logit_bias={300: 1.0}), "logit_bias")):
        with pytest.raises(InvalidRequest) as exc:
            admission.admit("y", list(range(10)), params)
        assert exc.value.param == field
    with pytest.raises(InvalidRequest) as exc:
        admission.admit("z", [1], SamplingParams(max_tokens=2), priority=3)
    assert exc.value.param == "priority"
