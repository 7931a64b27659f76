"""Prefix caching through the engine: shared prompt prefixes reuse blocks, outputs do not
change, eviction under pressure, and every block returns to the pool."""

import pytest

from pyserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SYSTEM = ("You are a helpful assistant. Answer briefly and precisely. The quick brown fox jumps "
          "over the lazy dog. ") * 6


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def prompts(tokenizer):
    return [tokenizer.encode(SYSTEM + q) for q in ("Hello, world!", "Paris is", "0 1 2 3", "Tokyo")]


def test_shared_prefix_reuses_blocks_and_keeps_outputs(model_dir):
    on = LLM(str(model_dir), kv_cache_memory="16MiB", block_size=16)
    off = LLM(str(model_dir), kv_cache_memory="16MiB", block_size=16, enable_prefix_caching=False)
    ids = prompts(on.get_tokenizer())
    shared = min(len(p) for p in ids)
    while any(p[:shared] != ids[0][:shared] for p in ids):
        shared -= 1
    shared_blocks = shared // 16
    assert shared_blocks >= 4

    kv = on.engine.kv
    first = on.generate({"prompt_token_ids": ids[0]}, GREEDY)
    assert kv.prefix_hits == 0
    rest = on.generate([{"prompt_token_ids": p} for p in ids[1:]], GREEDY)
    # the second request (and the others) found the shared full blocks cached
    assert kv.prefix_hits >= 3 * shared_blocks * 16
    assert kv.prefix_queries == sum(len(p) for p in ids)
    reference = off.generate([{"prompt_token_ids": p} for p in ids], GREEDY)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in reference]
    assert off.engine.kv.prefix_hits == 0
    for llm in (on, off):
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_blocks_are_shared_by_reference_while_running(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", max_num_batched_tokens=512)  # a prompt a step
    engine = llm.engine
    ids = prompts(llm.get_tokenizer())
    engine.add_request("a", ids[0], GREEDY)
    engine.step()  # a's prompt computed and its full blocks cached
    engine.add_request("b", ids[1], GREEDY)
    engine.step()
    a, b = engine.scheduler.running
    common = [x for x, y in zip(engine.kv.block_ids(a.request_id), engine.kv.block_ids(b.request_id))
              if x == y]
    assert len(common) >= 4
    assert all(engine.kv.pool.ref_count(block) == 2 for block in common)
    engine.abort("a")
    assert all(engine.kv.pool.ref_count(block) == 1 for block in common)
    engine.abort("b")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_eviction_under_pressure_and_preemption_keep_outputs(model_dir):
    block_bytes = 2 * 2 * 2 * 32 * 16 * 4  # K+V x 2 layers x 2 KV heads x head 32 x 16 tokens x fp32
    small = LLM(str(model_dir), kv_cache_memory=40 * block_bytes, max_model_len=512)
    big = LLM(str(model_dir), kv_cache_memory="16MiB", enable_prefix_caching=False)
    ids = prompts(small.get_tokenizer())
    others = [small.get_tokenizer().encode(f"Numbers: {i} {i + 1} {i + 2} and more words") * 8
              for i in range(4)]
    batch = [{"prompt_token_ids": p} for p in ids + others + ids]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = small.generate(batch, params)
    want = big.generate(batch, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    kv = small.engine.kv
    assert kv.pool.num_evictions > 0
    assert kv.num_free_blocks == kv.num_blocks


def test_a_burst_sharing_a_prefix_computes_it_once(model_dir):
    """Requests arriving together wait one step for the first to compute the shared blocks,
    then take them from the cache; outputs are those of a run without caching."""
    # steps of 512 tokens: the first prompt in one step
    on = LLM(str(model_dir), kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=512)
    off = LLM(str(model_dir), kv_cache_memory="16MiB", block_size=16, enable_prefix_caching=False,
              max_num_batched_tokens=512)
    ids = prompts(on.get_tokenizer())
    core = on.engine
    for i, p in enumerate(ids):
        core.add_request(f"r{i}", p, GREEDY)
    first = core.schedule()
    assert [s.request_id for s in first.sequences] == ["r0"]  # the others wait for its blocks
    outputs = {o.request_id: o for o in core.update(first, core.run(core.prepare(first)))}
    second = core.schedule()
    admitted = [s for s in second.sequences if s.request_id != "r0"]
    assert len(admitted) == 3
    assert all(s.start >= 4 * 16 for s in admitted)  # their cached prefix is not computed again
    for o in core.update(second, core.run(core.prepare(second))):
        outputs[o.request_id] = o
    while core.has_unfinished():
        for o in core.step():
            outputs[o.request_id] = o
    reference = off.generate([{"prompt_token_ids": p} for p in ids], GREEDY)
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(4)] == \
           [o.outputs[0].token_ids for o in reference]
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.kv._computing


def test_a_preempted_or_aborted_prefix_owner_releases_the_waiters(model_dir):
    on = LLM(str(model_dir), kv_cache_memory="16MiB", block_size=16)
    ids = prompts(on.get_tokenizer())
    core = on.engine
    core.add_request("owner", ids[0], GREEDY)
    core.add_request("waiter", ids[1], GREEDY)
    assert [s.request_id for s in core.schedule().sequences] == ["owner"]
    core.abort("owner")  # before its step ran: its blocks were never cached
    assert [s.request_id for s in core.schedule().sequences] == ["waiter"]
    assert not core.kv._computing or all(core.kv._computing.values())


def test_block_order_trades_cached_prefixes_for_memory_written(model_dir):
    """resident (the CPU's default) reuses the blocks of finished requests, evicting their
    cached prefixes, before it writes a block never used; lru (vLLM's order) uses every block
    once first and so still holds the first prompt when it comes back."""
    distinct = [[10 + i] + [(7 * i + j) % 200 + 20 for j in range(63)] for i in range(4)]
    touched, repeat_hits = {}, {}
    for order in ("auto", "resident", "lru"):
        llm = LLM(str(model_dir), kv_cache_memory="16MiB", block_size=16, kv_block_order=order,
                  device="cpu")
        kv = llm.engine.kv
        for ids in distinct:
            llm.generate({"prompt_token_ids": ids}, GREEDY)
        touched[order] = kv.pool.num_touched
        hits = kv.prefix_hits
        llm.generate({"prompt_token_ids": distinct[0]}, GREEDY)
        repeat_hits[order] = kv.prefix_hits - hits
        assert kv.num_free_blocks == kv.num_blocks
    per_request = -(-(64 + 12) // 16)
    assert touched["resident"] == touched["auto"] == per_request
    assert touched["lru"] == 4 * per_request
    assert repeat_hits["resident"] == 0 and repeat_hits["lru"] == 48  # 3 full blocks


def test_waiters_on_a_prefix_longer_than_a_step_are_admitted_together(model_dir):
    """The shared prefix takes the first request several steps (64-token steps): the others
    wait for it, not for each other, and are admitted in the one step after its chunks have
    computed the shared blocks (issue 68 asked whether the wait could serialise a burst)."""
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=64)
    ids = prompts(llm.get_tokenizer())
    shared_blocks = min(len(p) for p in ids) // 16
    while any(p[:shared_blocks * 16] != ids[0][:shared_blocks * 16] for p in ids):
        shared_blocks -= 1
    assert shared_blocks * 16 > 2 * 64  # several of the first request's steps
    core = llm.engine
    for i, p in enumerate(ids):
        core.add_request(f"r{i}", p, GREEDY)
    admitted_at = {}
    step_no = 0
    while core.has_unfinished():
        step = core.schedule()
        for seq in step.sequences:
            admitted_at.setdefault(seq.request_id, (step_no, seq.start))
        core.update(step, core.run(core.prepare(step)))
        step_no += 1
    first_step = -(-shared_blocks * 16 // 64)  # the steps r0 takes to compute the shared blocks
    assert {admitted_at[f"r{i}"][0] for i in (1, 2, 3)} == {first_step}
    assert all(admitted_at[f"r{i}"][1] == shared_blocks * 16 for i in (1, 2, 3))
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.kv._computing
