"""The offline LLM through the real engine on a tiny random model: stopping rules, refusals,
seeded sampling, chunked prefill, preemption and block accounting."""

import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.sampling_params import SamplingParams as SP

PROMPTS = ["Hello, world!", "The quick brown fox jumps over", "Paris is the capital of", "0 1 2 3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory="16MiB", max_model_len=256)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(PROMPTS, GREEDY)


def test_max_tokens_ends_with_length(reference):
    for out in reference:
        assert len(out.outputs[0].token_ids) == 32
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text


def test_metrics_time_the_request_in_order(llm, reference):
    """RequestOutput.metrics (vLLM's fields): arrival, then scheduling, then the first token,
    then the last; a one-token request's first token is its last."""
    for out in reference:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time < m.last_token_time
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
    one = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1))[0].metrics
    assert one.first_token_time == one.last_token_time


def test_stop_string_cuts_the_text(llm, reference):
    full = reference[1].outputs[0]
    stop = full.text[10:14]
    at = full.text.find(stop)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])
    out = llm.generate(PROMPTS[1], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:at]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    kept = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=stop,
                          include_stop_str_in_output=True)
    assert llm.generate(PROMPTS[1], kept)[0].outputs[0].text == full.text[: at + len(stop)]


def test_stop_token_ids_and_min_tokens(llm, reference):
    ids = reference[0].outputs[0].token_ids
    k = 5
    stop_id = ids[k]
    first = ids.index(stop_id)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                 stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # Below min_tokens the stop token is masked out, so it cannot appear there.
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                 stop_token_ids=[stop_id], min_tokens=12))[0].outputs[0]
    assert stop_id not in out.token_ids[:12] and len(out.token_ids) >= 12


def test_eos_stops_unless_ignored(llm, reference):
    eos = llm.get_tokenizer().eos_token_id
    forced = reference[2].outputs[0].token_ids[3]
    # Make the greedy path's 4th token the EOS by declaring it EOS for the engine.
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (forced,)
    try:
        out = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
        ignored = llm.generate(PROMPTS[2], GREEDY)[0].outputs[0]
    finally:
        engine.eos_token_ids = saved
    first = reference[2].outputs[0].token_ids.index(forced)
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == reference[2].outputs[0].token_ids[: first + 1]
    assert ignored.token_ids == reference[2].outputs[0].token_ids
    assert eos is not None


def test_refusals_name_the_problem(llm):
    too_long = list(range(3, 259))
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.generate({"prompt_token_ids": too_long}, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("Hello", SamplingParams(max_tokens=400))
    with pytest.raises(ValueError, match="Token id 99999 is out of vocabulary"):
        llm.generate({"prompt_token_ids": [1, 99999]}, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias={5: 200}), "logit_bias"), (dict(logprobs=-2), "logprobs"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SP(**kwargs)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded)[0].outputs[0].token_ids
    in_batch = llm.generate(PROMPTS, [GREEDY, seeded, GREEDY, GREEDY])[1].outputs[0].token_ids
    assert alone == in_batch
    other = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate(PROMPTS[1], other)[0].outputs[0].token_ids != alone


def test_chunked_prefill_and_preemption_leave_outputs_unchanged(model_dir, reference):
    # 6 blocks of 16 tokens cannot hold four 40-token sequences at once: requests get
    # preempted and recomputed; prompts are also split into 3-token chunks.
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K+V x 2 layers x 2 KV heads x head 16 x 16 tokens x fp32
    llm = LLM(str(model_dir), kv_cache_memory=6 * block_bytes, max_model_len=64,
              max_num_batched_tokens=3)
    engine = llm.engine
    assert engine.kv.num_blocks == 6
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", llm.get_tokenizer().encode(PROMPTS[1]), GREEDY)
    engine.add_request("b", llm.get_tokenizer().encode(PROMPTS[2]), GREEDY)
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    engine.abort("a")
    engine.abort("b")
    assert not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_priority_policy_runs_urgent_requests_first(model_dir):
    llm = LLM(str(model_dir), max_num_seqs=1, scheduling_policy="priority", kv_cache_memory="16MiB",
              max_model_len=256)
    engine = llm.engine
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    engine.add_request("late", ids, SamplingParams(temperature=0.0, max_tokens=4), priority=5)
    engine.add_request("urgent", ids, SamplingParams(temperature=0.0, max_tokens=4), priority=-1)
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "late"]


def test_profile_run_borrows_and_returns_blocks(llm):
    engine = llm.engine
    assert engine.profile_run() > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.has_unfinished()


def test_step_limits_default_per_device(llm, model_dir):
    """--max-num-seqs and --max-num-batched-tokens unset: 128 and 128 on the CPU (engine/core.py
    says why), and what the scheduler uses is the resolved value; given values are kept, a
    budget never below the sequence count."""
    assert llm.engine.config.scheduler.max_num_batched_tokens == 128
    assert llm.engine.scheduler.config.max_num_batched_tokens == 128
    assert llm.engine.scheduler.config.max_num_seqs == 128
    given = LLM(str(model_dir), kv_cache_memory="16MiB", max_model_len=256, max_num_batched_tokens=40)
    assert (given.engine.scheduler.config.max_num_batched_tokens, given.engine.scheduler.config.max_num_seqs) == (40, 40)
    seqs = LLM(str(model_dir), kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=300)
    assert (seqs.engine.scheduler.config.max_num_batched_tokens, seqs.engine.scheduler.config.max_num_seqs) == (300, 300)
    from pyserve.config import SchedulerConfig
    from pyserve.executor.plan import resolve_step_limits
    cuda = resolve_step_limits(SchedulerConfig(), torch.device("cuda"))
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens) == (256, 2048)


def test_generation_config_supplies_the_defaults(model_dir, tmp_path):
    """vLLM's --generation-config auto: generation_config.json's sampling values stand in for
    what the caller leaves out; `vllm` ignores them."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 5, "top_k": 7, "do_sample": True}))
    llm = LLM(str(model), kv_cache_memory="16MiB", max_model_len=256)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 5, 7)
    out = llm.generate(PROMPTS[0])[0].outputs[0]
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= 5
    llm.shutdown()
    plain = LLM(str(model), kv_cache_memory="16MiB", max_model_len=256, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    plain.shutdown()
