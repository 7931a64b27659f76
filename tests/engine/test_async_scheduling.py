"""Async scheduling (engine/step_chain.py, engine/continuation.py): the model thread runs the
next decode step straight after the last, planned while that one ran. It must change no
output, drop the rows of requests that ended meanwhile, give back every KV block, and fall back
to plain scheduling wherever the next step is not known in advance."""

import asyncio
import threading

import pytest
import torch
import uvloop

from pyserve import SamplingParams
from pyserve.config import Config
from pyserve.engine.async_engine import AsyncEngine
from pyserve.engine.continuation import MAX_CONTINUED_SEQUENCES
from pyserve.engine.core import EngineCore
from pyserve.engine.step_chain import StepChain
from pyserve.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA
PROMPTS = ["Hello, world!", "The quick brown fox jumps over", "Paris is the capital of", "0 1 2 3",
           "Tokyo is the capital of Japan. Python, C++ and CUDA.", "A paged KV cache"]


def _params() -> list[SamplingParams]:
    """Greedy and seeded sampling, logprobs, min_tokens, a stop string, different lengths (so
    that requests end while the next step runs), and two completions of one prompt."""
    return [
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, output_kind=DELTA),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=23, logprobs=2,
                       output_kind=DELTA),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, logprobs=1, output_kind=DELTA),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=9, n=2, output_kind=DELTA),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[" the"], output_kind=DELTA),
        SamplingParams(temperature=0.7, seed=3, max_tokens=1, output_kind=DELTA),
    ]


async def _collect(engine, tokenizer, prompt, params, request_id, delay):
    await asyncio.sleep(delay)
    by_index = {}
    async for out in engine.generate(tokenizer.encode(prompt), params, request_id):
        for completion in out.outputs:
            ids, logprobs, finish = by_index.setdefault(completion.index, ([], [], [None]))
            ids += completion.token_ids
            logprobs += [sorted(lp.items()) for lp in completion.logprobs or []]
            finish[0] = completion.finish_reason
    return by_index


def _serve(model_dir, async_scheduling, delays):
    async def main():
        core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB",
                                           max_num_batched_tokens=32,
                                           async_scheduling=async_scheduling))
        engine = AsyncEngine(core)
        results = await asyncio.gather(*(
            _collect(engine, core.tokenizer, prompt, params, f"r{i}", delay)
            for i, (prompt, params, delay) in enumerate(zip(PROMPTS, _params(), delays))))
        chained = engine._chain.num_chained if engine._chain is not None else 0
        free, total = core.kv.num_free_blocks, core.kv.num_blocks
        books = core.books()
        await engine.shutdown()
        return results, chained, free, total, books

    return uvloop.run(main())


@pytest.mark.parametrize("delays", [(0.0,) * 6, (0.0, 0.02, 0.05, 0.01, 0.08, 0.03)],
                         ids=["together", "staggered"])
def test_outputs_equal_to_plain_scheduling(model_dir, delays):
    plain, plain_chained, *_ = _serve(model_dir, False, delays)
    chained_results, chained, free, total, books = _serve(model_dir, True, delays)
    assert plain_chained == 0
    assert chained > 0  # the decode runs did go from one step straight into the next
    assert chained_results == plain
    assert free == total  # rows of ended requests computed ahead left no block behind
    assert books["requests_in_table"] == 0 and books["num_running"] == 0
    assert books["kv_blocks_referenced"] == 0 and books["kv_manager_requests"] == 0
    finishes = [r[0][2][0] for r in chained_results]
    assert finishes[0] == "length" and finishes[5] == "length"


def test_aborts_while_chained_leave_no_blocks_and_the_engine_serves_on(model_dir):
    async def main():
        core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB"))
        engine = AsyncEngine(core)
        tok = core.tokenizer
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=DELTA)

        async def cut_after(request_id, n):
            got = 0
            async for out in engine.generate(tok.encode(PROMPTS[1]), long, request_id):
                got += len(out.outputs[0].token_ids)
                if got >= n:
                    break  # leaving the stream aborts the request
            return got

        cut = await asyncio.gather(*(cut_after(f"cut{i}", 5 + 7 * i) for i in range(4)))
        await asyncio.sleep(0.05)  # the step that ran ahead ends
        chained = engine._chain.num_chained
        free_after_aborts = core.kv.num_free_blocks
        short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=DELTA)
        ids = []
        async for out in engine.generate(tok.encode(PROMPTS[2]), short, "after"):
            ids += out.outputs[0].token_ids
        free_end = core.kv.num_free_blocks
        await engine.shutdown()
        return cut, chained, free_after_aborts, free_end, core.kv.num_blocks, ids

    cut, chained, free_after_aborts, free_end, total, ids = uvloop.run(main())
    assert cut == [5, 12, 19, 26] and chained > 0
    assert free_after_aborts == total and free_end == total
    reference = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    from pyserve import LLM
    alone = LLM(str(model_dir), kv_cache_memory="16MiB", async_scheduling=False)
    assert ids == alone.generate(PROMPTS[2], reference)[0].outputs[0].token_ids


def _same_tensor(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_continued_batches_equal_batches_prepared_from_scratch(model_dir):
    """prepare_continuation builds the next batch from the running one: across a new block
    (the table grows) and where min_tokens stops banning EOS (the bias changes), it must equal
    what prepare() builds from the same step, in every entry the step reads."""
    core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB", block_size=16))
    tok = core.tokenizer
    prompt = tok.encode(PROMPTS[4])[:14]
    core.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3,
                                                 logit_bias={5: 2.0}, logprobs=1))
    core.add_request("b", prompt[:9], SamplingParams(temperature=0.8, seed=5, max_tokens=12))
    step, prepared = core.begin_step()
    grew, rebuilt = 0, []
    for i in range(8):
        plan = core.plan_continuation(step)
        assert plan is not None and plan.rows == [0, 1]
        fast = core.prepare_continuation(prepared, plan.step)
        full = core.prepare(plan.step)
        a, b = fast.inputs, full.inputs
        assert torch.equal(a.positions, b.positions) and torch.equal(a.logits_rows, b.logits_rows)
        assert torch.equal(a.meta.slot_mapping, b.meta.slot_mapping)
        assert torch.equal(a.meta.seq_lens, b.meta.seq_lens)
        assert torch.equal(a.meta.query_start_loc, b.meta.query_start_loc)
        for row, seq in enumerate(plan.step.sequences):  # the entries up to the row's position
            used = seq.start // 16 + 1
            assert torch.equal(a.meta.block_tables[row, :used], b.meta.block_tables[row, :used])
        grew += any(seq.start % 16 == 0 for seq in plan.step.sequences)
        m, n = fast.sampling, full.sampling
        assert fast.num_sampled == full.num_sampled == 2
        assert torch.equal(m.temperature, n.temperature) and torch.equal(m.greedy, n.greedy)
        assert m.all_greedy == n.all_greedy and m.max_num_logprobs == n.max_num_logprobs
        assert _same_tensor(m.top_p, n.top_p) and _same_tensor(m.top_k, n.top_k)
        assert (m.bias is None) == (n.bias is None)
        if m.bias is not None:
            assert all(torch.equal(x, y) for x, y in zip(m.bias, n.bias))
        assert m.generators == n.generators
        if m is not prepared.sampling:
            rebuilt.append(i)
        result = core.run(prepared)
        fast.fill_tokens([result.sampled.token_ids[r] for r in plan.rows])
        core.update(step, result)
        step, prepared = plan.step, fast
    assert grew >= 1
    # from scratch after the prompts' step; rebuilt where "a" reaches min_tokens (its third
    # output token is sampled in the third continuation); reused in every other
    assert rebuilt == [0, 2]


def test_no_continuation_where_the_next_step_is_not_known(model_dir):
    """Penalties read the token being sampled, a waiting request would join the next step, and
    a prompt still being chunked samples nothing: no offer in any of these."""
    core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB",
                                       max_num_batched_tokens=16))
    tok = core.tokenizer
    core.add_request("plain", tok.encode(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=8))
    step, _ = core.begin_step()  # the whole prompt, sampled
    plan = core.plan_continuation(step)
    first = step.sequences[0]
    assert plan is not None and [s.start for s in plan.step.sequences] == [first.start + len(first.token_ids)]
    assert plan.rows == [0]

    core.add_request("penalized", tok.encode(PROMPTS[3]),
                     SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.2))
    assert core.plan_continuation(step) is None  # a request waits
    core2 = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB",
                                        max_num_batched_tokens=16))
    core2.add_request("p", tok.encode(PROMPTS[3]),
                      SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.2))
    step2, _ = core2.begin_step()
    assert core2.plan_continuation(step2) is None  # penalties
    core3 = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB",
                                        max_num_batched_tokens=16))
    core3.add_request("long", tok.encode(PROMPTS[4] * 3), SamplingParams(temperature=0.0, max_tokens=8))
    step3, _ = core3.begin_step()
    assert step3.sequences[0].sampling is None and core3.plan_continuation(step3) is None
    core4 = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB"))
    core4.add_request("last", tok.encode(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=1))
    step4, _ = core4.begin_step()
    assert core4.plan_continuation(step4) is None  # its one token ends it
    core5 = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB"))
    for i in range(MAX_CONTINUED_SEQUENCES + 1):
        core5.add_request(f"many{i}", tok.encode(PROMPTS[i]), SamplingParams(temperature=0.0, max_tokens=8))
    step5, _ = core5.begin_step()
    assert len(step5.sequences) == MAX_CONTINUED_SEQUENCES + 1
    assert core5.plan_continuation(step5) is None  # a large step: scheduled as usual


def test_a_withdrawn_or_late_offer_is_not_run():
    """The chain's hand-over alone, around a stand-in for the engine's step."""
    ran = []

    class Batch:
        def __init__(self, name):
            self.name = name
            self.tokens = None

        def fill_tokens(self, tokens):
            self.tokens = tokens

    class Sampled:
        def __init__(self, ids):
            self.token_ids = ids

    class Result:
        def __init__(self, ids):
            self.sampled = Sampled(ids)

    gate = threading.Event()

    def run(batch):
        gate.wait(5)
        ran.append(batch.name)
        return Result([10, 20, 30])

    async def main():
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1)
        chain = StepChain(asyncio.get_running_loop(), pool, run)
        first = chain.start(Batch("a"))
        chain.offer("step-b", Batch("b"), [2, 0])
        chain.withdraw()
        gate.set()
        await first
        assert chain.claim() is None  # withdrawn before the step ended: nothing ran after it

        gate.clear()
        second = chain.start(Batch("c"))
        offered = Batch("d")
        chain.offer("step-d", offered, [2, 0])
        gate.set()
        await second
        claimed = chain.claim()
        assert claimed is not None and claimed[0] == "step-d" and claimed[1] is offered
        await claimed[2]
        assert offered.tokens == [30, 10]  # the rows it continues, in its order

        third = chain.start(Batch("e"))
        await third
        chain.offer("step-f", Batch("f"), [0])  # the step already ended: too late
        assert chain.claim() is None
        pool.shutdown(wait=True)
        return chain.num_chained

    assert uvloop.run(main()) == 1
    assert ran == ["a", "c", "d", "e"]
