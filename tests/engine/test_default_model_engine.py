"""The engine with the default model under concurrency: 32 requests of mixed lengths arriving
at staggered times give, for greedy requests, exactly the tokens each gives alone; so do a KV
cache small enough to force preemption and prefix caching off; seeded requests repeat."""

import asyncio

import pytest
import uvloop

from pyserve import LLM, SamplingParams
from pyserve.engine.async_engine import AsyncEngine
from pyserve.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

TOPICS = ["the sea", "a city at night", "paged memory", "bread", "mountains", "a robot", "tea",
          "winter"]
SYSTEM = "You are a concise assistant who answers in one or two sentences. " * 4


def prompts() -> list[str]:
    out = []
    for i in range(32):
        topic = TOPICS[i % len(TOPICS)]
        head = SYSTEM if i % 3 == 0 else ""
        out.append(head + f"Question {i}: say something about {topic}." + " Be vivid." * (i % 5))
    return out


MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def alone(default_model_dir):
    llm = LLM(str(default_model_dir), enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts()]


def run_concurrently(model_dir, **flags) -> tuple[list[list[int]], dict]:
    from pyserve.config import Config
    from pyserve.engine.core import EngineCore

    async def one(engine, tok, i, prompt, params):
        await asyncio.sleep(0.02 * (i % 8))
        ids = []
        async for out in engine.generate(tok.encode(prompt), params, f"r{i}"):
            ids += out.outputs[0].token_ids
        return ids

    async def main():
        core = EngineCore(Config.from_flat(model=str(model_dir), **flags))
        engine = AsyncEngine(core)
        results = await asyncio.gather(*(one(engine, core.tokenizer, i, p, GREEDY)
                                         for i, p in enumerate(prompts())))
        await engine.shutdown()
        assert core.kv.num_free_blocks == core.kv.num_blocks
        return results, core.snapshot()

    return uvloop.run(main())


def test_concurrent_requests_match_alone(default_model_dir, alone):
    got, snap = run_concurrently(default_model_dir, max_num_batched_tokens=256)
    assert got == alone
    assert snap["prefix_cache_hits"] > 0


def test_preemption_keeps_outputs(default_model_dir, alone):
    # 40 blocks of 16 tokens = 640 tokens for 32 requests of ~40-90 tokens each
    block = 2 * 30 * 3 * 64 * 16 * 4
    got, snap = run_concurrently(default_model_dir, kv_cache_memory=40 * block, max_model_len=512)
    assert snap["num_preemptions"] > 0
    assert got == alone


def test_prefix_caching_off_keeps_outputs(default_model_dir, alone):
    got, snap = run_concurrently(default_model_dir, enable_prefix_caching=False)
    assert snap["prefix_cache_hits"] == 0
    assert got == alone


def test_seeded_requests_repeat(default_model_dir):
    llm = LLM(str(default_model_dir))
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=16, ignore_eos=True)
              for s in range(6)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts()[:6], params)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts()[:6][::-1], params[::-1])][::-1]
    assert first == second


def test_streamed_deltas_add_up_for_non_ascii_prompts(default_model_dir):
    from pyserve.config import Config
    from pyserve.engine.core import EngineCore

    texts = ["Traduis en français : « Le café est très chaud ». Réponds en français.",
             "日本語で短い詩を書いてください。",
             "Напиши одно предложение о зиме. 🎄❄️",
             "Write three emoji that describe the sea, then explain them: 🌊🐚"]
    params = SamplingParams(temperature=0.0, max_tokens=40, output_kind=RequestOutputKind.DELTA,
                            stop=["\n\n"])

    async def main():
        core = EngineCore(Config.from_flat(model=str(default_model_dir)))
        engine = AsyncEngine(core)
        tok = core.tokenizer

        async def one(i, text):
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            deltas, tokens = [], []
            async for out in engine.generate(ids, params, f"r{i}"):
                deltas.append(out.outputs[0].text)
                tokens += out.outputs[0].token_ids
            return deltas, tokens

        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
        await engine.shutdown()
        return tok, results

    tok, results = uvloop.run(main())
    non_ascii = 0
    for deltas, tokens in results:
        text = "".join(deltas)
        assert all("\ufffd" not in d for d in deltas)
        decoded = tok.decode(tokens, skip_special_tokens=True)
        assert decoded.startswith(text) and "\n\n" not in text
        non_ascii += any(ord(c) > 127 for c in text)
    assert non_ascii >= 2
