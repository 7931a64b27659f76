"""Pooling requests (embeddings) through the real engine on tiny random models, against
transformers' hidden states of the same weights: LAST, MEAN, CLS and per-token pooling,
chunked prompts, prefix caching, preemption, batches shared with generation, and the books
(blocks, requests) balanced afterwards."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers

from pyserve.engine.core import EngineCore
from pyserve.config import Config
from pyserve.errors import InvalidRequest
from pyserve.llm import LLM
from pyserve.pooling_params import PoolingParams
from pyserve.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = [[1, 5, 9, 33, 44, 12, 7, 99, 100, 101, 23], [1, 7, 8], list(range(3, 60))]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    """prompt -> transformers' final-norm hidden states [n, H] (float32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    def hidden(ids):
        with torch.no_grad():
            return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return hidden


def run(core, prompts, params=PoolingParams()):
    for i, p in enumerate(prompts):
        core.add_pooling_request(f"e{i}", p, params)
    out = {}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] = o
    return [out[f"e{i}"] for i in range(len(prompts))]


def assert_books_balanced(core):
    assert not core.has_unfinished() and len(core.requests) == 0
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert core.executor.runner.num_tracked_requests == 0


def engine(model_dir, **flags):
    return EngineCore(Config.from_flat(model=str(model_dir), **flags))


@pytest.mark.parametrize("budget", [8, 128])  # chunked over several steps, and whole
def test_last_token_pooling_equals_transformers(model_dir, reference, budget):
    core = engine(model_dir, max_num_batched_tokens=budget, max_num_seqs=4)
    for prompt, out in zip(PROMPTS, run(core, PROMPTS)):
        want = F.normalize(reference(prompt)[-1], dim=-1)
        assert out.finished and out.outputs == [] and out.pooled.shape == want.shape
        torch.testing.assert_close(out.pooled, want, atol=1e-5, rtol=0)
    assert_books_balanced(core)


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_from_the_pooler_config(model_dir, reference, kind):
    core = engine(model_dir, max_num_batched_tokens=8, max_num_seqs=4,
                  pooler_config=json.dumps({"pooling_type": kind, "normalize": False}))
    for prompt, out in zip(PROMPTS, run(core, PROMPTS)):
        hidden = reference(prompt)
        want = hidden.mean(dim=0) if kind == "MEAN" else hidden[0]
        torch.testing.assert_close(out.pooled, want, atol=1e-5, rtol=1e-5)
    assert_books_balanced(core)


def test_per_token_pooling_and_a_request_normalize(model_dir, reference):
    core = engine(model_dir, max_num_batched_tokens=8, max_num_seqs=4)
    outs = run(core, PROMPTS, PoolingParams(task="token_embed", normalize=False))
    for prompt, out in zip(PROMPTS, outs):
        torch.testing.assert_close(out.pooled, reference(prompt), atol=1e-5, rtol=1e-5)
    raw = run(core, PROMPTS[:1], PoolingParams(normalize=False))[0].pooled
    torch.testing.assert_close(raw, reference(PROMPTS[0])[-1], atol=1e-5, rtol=1e-5)


def test_the_prefix_cache_serves_last_token_pooling(model_dir, reference):
    core = engine(model_dir, max_num_batched_tokens=128)
    first, = run(core, [PROMPTS[2]])
    again, = run(core, [PROMPTS[2]])
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48  # 3 full blocks of 16
    torch.testing.assert_close(again.pooled, first.pooled, atol=1e-6, rtol=0)
    # a pooling request's blocks serve a later generation too
    group = core.add_request("g", PROMPTS[2] + [5], SamplingParams(temperature=0, max_tokens=2))
    while core.has_unfinished():
        core.step()
    assert group.children[0].num_cached_tokens == 48
    assert_books_balanced(core)


def test_generation_in_the_same_batches_is_unchanged(model_dir):
    greedy = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY)
    alone = LLM(str(model_dir), max_num_batched_tokens=16).generate([PROMPTS[0]], greedy)[0]
    core = engine(model_dir, max_num_batched_tokens=16)
    core.add_request("g", PROMPTS[0], greedy)
    for i, p in enumerate(PROMPTS):
        core.add_pooling_request(f"e{i}", p, PoolingParams())
    mixed, pooled = None, 0
    while core.has_unfinished():
        for o in core.step():
            if o.request_id == "g":
                mixed = o
            else:
                pooled += 1
    assert pooled == 3 and mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_books_balanced(core)


def test_a_preempted_pooling_request_restarts_and_pools_the_same(model_dir, reference):
    # 6 blocks of 16 tokens: two 60-token generations and a MEAN pooling of 57 cannot all fit
    core = engine(model_dir, max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory=6 * 8192,
                  max_model_len=96, scheduling_policy="priority",
                  pooler_config='{"pooling_type": "MEAN"}')
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    core.add_request("g0", list(range(5, 35)), long)
    core.add_request("g1", list(range(6, 36)), long)
    core.add_pooling_request("e", PROMPTS[2], PoolingParams(), priority=1)  # the victim
    out = None
    while core.has_unfinished():
        for o in core.step():
            out = o if o.request_id == "e" else out
    assert core.scheduler.num_preemptions > 0
    torch.testing.assert_close(out.pooled, F.normalize(reference(PROMPTS[2]).mean(0), dim=-1),
                               atol=1e-5, rtol=1e-5)
    assert_books_balanced(core)


def test_an_aborted_pooling_request_frees_its_blocks(model_dir):
    core = engine(model_dir, max_num_batched_tokens=8)
    core.add_pooling_request("e", PROMPTS[2], PoolingParams())
    core.step()
    assert core.kv.num_free_blocks < core.kv.num_blocks
    core.abort("e")
    assert_books_balanced(core)


def test_what_a_pooling_request_cannot_have(model_dir):
    core = engine(model_dir, max_model_len=64)
    for ids, param in (([], "input"), ([1, 10**6], "input"), ([1] * 65, "input")):
        with pytest.raises(InvalidRequest) as err:
            core.add_pooling_request("x", ids, PoolingParams())
        assert err.value.param == param
    core.add_pooling_request("full", [1] * 64, PoolingParams())  # the whole length: nothing is generated
    with pytest.raises(InvalidRequest, match="matryoshka") as err:
        core.add_pooling_request("y", [1, 2], PoolingParams(dimensions=8))
    assert err.value.param == "dimensions"
    with pytest.raises(InvalidRequest):
        PoolingParams(task="classify")


def test_matryoshka_dimensions_cut_before_normalising(model_dir, reference, tmp_path):
    folder = tmp_path / "matryoshka"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(folder))
    out = llm.embed([PROMPTS[0]], PoolingParams(dimensions=16))[0]
    want = F.normalize(reference(PROMPTS[0])[-1][:16], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=0)
    with pytest.raises(InvalidRequest, match="16, 32"):
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=24))
