"""Pipeline parallelism with the mp backend on the CPU: the layers split into stages in worker
processes, activations handed stage to stage through shared memory, the last stage's logits
back to rank 0, with steps cut into micro-batches (so that stages overlap) and not. The
oracle is the same engine at TP=1, PP=1: greedy ids equal, logprobs equal to float32 reduction noise (TP
all-reduces sum in another order)."""

import os
import signal
import threading
import time

import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.config import Config
from pyserve.errors import ModelLoadError
from pyserve.executor.plan import resolve
from pyserve.executor.shard import kv_layout
from pyserve.model.layers.parallel import SINGLE, pipeline_stage, stage_layer_counts
from pyserve.model.loader import iterate_safetensors, load_model, safetensors_files
from tests.executor.ranks import alive, assert_same_greedy, segments_of

PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 200, 300], list(range(3, 60)), [7] * 20]
# small steps: the long prompt's prefill is chunked over several steps, beside running decodes
STEP_FLAGS = dict(kv_cache_memory=1 << 22, max_num_batched_tokens=32, max_num_seqs=8)
# (model, tensor-parallel size, pipeline-parallel size, micro-batches per step), each compared
# with the model at TP=1, PP=1
# (llama at TP=2 x PP=2 last: the tests after these use it too)
CASES = [("llama", 1, 2, 1), ("llama", 1, 2, 2), ("llama", 2, 2, 3),
         ("llama", 1, 3, 2),  # a middle stage, which receives and sends
         ("gemma3", 1, 2, 2), ("gemma3", 2, 2, 1), ("llama", 2, 2, 1)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """llama with 3 layers (uneven: stages of 2 and 1; untied head; a separate residual) and
    gemma3 with 4 (tied embeddings: the last stage loads the embedding for its head; the
    residual stream is the hidden state)."""
    from make_tiny_model import make_tiny_model  # tools/, on the path (tests/conftest.py)

    return {"llama": make_tiny_model(tmp_path_factory.mktemp("pp-llama"), "llama", num_layers=3),
            "gemma3": make_tiny_model(tmp_path_factory.mktemp("pp-gemma3"), "gemma3")}


@pytest.fixture(scope="module")
def engines(models):
    """get(arch, tp, pp, micro_batches) -> an LLM, started once for the module; one with
    worker processes at a time (starting another shuts the last down), beside the TP=1 ones."""
    started = {}

    def get(arch: str, tp: int = 1, pp: int = 1, micro_batches: int = 1) -> LLM:
        key = (arch, tp, pp, micro_batches)
        if key not in started:
            for other in [k for k in started if k[1] * k[2] > 1]:
                started.pop(other).shutdown()
            started[key] = LLM(str(models[arch]), tensor_parallel_size=tp, pipeline_parallel_size=pp,
                               pipeline_micro_batches=micro_batches, **STEP_FLAGS)
        return started[key]

    get.started = started
    yield get
    for llm in started.values():
        llm.shutdown()


def greedy(llm: LLM):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)


def test_layers_split_as_evenly_as_vllm_splits_them():
    assert stage_layer_counts(3, 2) == [2, 1]
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    stages = [pipeline_stage(10, 4, i) for i in range(4)]
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert stages[0].is_first and stages[-1].is_last and not stages[1].is_last


def test_micro_batches_are_runs_of_whole_sequences_cut_near_even_token_shares():
    from pyserve.executor.pipeline_micro_batches import split_micro_batches
    from pyserve.model.layers.attention import AttentionMetadata

    lengths = [5, 1, 1, 8, 1]  # tokens this step, per sequence
    starts = torch.tensor([0, 5, 6, 7, 15, 16], dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(16) + 100, torch.arange(10, dtype=torch.int32).view(5, 2),
                             starts, torch.tensor([9, 4, 3, 20, 7], dtype=torch.int32))
    two = split_micro_batches(meta, 2)
    assert [(mb.tokens.start, mb.tokens.stop) for mb in two] == [(0, 7), (7, 16)]
    second = two[1].meta
    assert second.query_start_loc.tolist() == [0, 8, 9] and second.seq_lens.tolist() == [20, 7]
    assert second.block_tables.tolist() == [[6, 7], [8, 9]]
    assert second.slot_mapping.tolist() == list(range(107, 116))
    three = split_micro_batches(meta, 3)
    assert [(mb.tokens.start, mb.tokens.stop) for mb in three] == [(0, 5), (5, 7), (7, 16)]
    assert len(split_micro_batches(meta, 9)) == len(lengths)  # at least one sequence each
    assert [(mb.tokens.start, mb.tokens.stop) for mb in split_micro_batches(meta, 1)] == [(0, 16)]


def _params(model) -> set[str]:
    return {name for name, _ in model.named_parameters()}


def test_each_stage_reads_and_holds_only_its_layers(models):
    path = models["llama"]
    arch = resolve(Config.from_flat(model=str(path))).shard.arch
    first, last = pipeline_stage(3, 2, 0), pipeline_stage(3, 2, 1)
    read = [name for name, _ in iterate_safetensors(safetensors_files(path), last)]
    assert read and not any(f".layers.{i}." in n for n in read for i in (0, 1))
    load = lambda stage: _params(load_model(arch, path, "auto", torch.float32, torch.device("cpu"),
                                            64, 0, SINGLE, stage=stage))
    head, tail = load(first), load(last)
    assert "model.embed_tokens.weight" in head and "lm_head.weight" not in head
    assert "model.norm.weight" not in head and any(".layers.1." in n for n in head)
    assert not any(".layers.2." in n for n in head)
    assert "model.embed_tokens.weight" not in tail  # untied: the head has its own matrix
    assert {"lm_head.weight", "model.norm.weight"} <= tail
    assert not any(f".layers.{i}." in n for n in tail for i in (0, 1))
    assert head | tail == load(pipeline_stage(3, 1, 0))  # together, the whole model

    garch = resolve(Config.from_flat(model=str(models["gemma3"]))).shard.arch
    gtail = _params(load_model(garch, models["gemma3"], "auto", torch.float32, torch.device("cpu"),
                               64, 0, SINGLE, stage=pipeline_stage(4, 2, 1)))
    assert "model.embed_tokens.weight" in gtail  # tied: the last stage's head is the embedding
    assert not any(f".layers.{i}." in n for n in gtail for i in (0, 1))


@pytest.mark.parametrize("arch,tp,pp,micro_batches", CASES, ids=lambda v: str(v))
def test_greedy_output_and_logprobs_equal_tp1(engines, arch, tp, pp, micro_batches):
    want, got = greedy(engines(arch)), greedy(engines(arch, tp, pp, micro_batches))
    assert_same_greedy(want, got)
    for one, two in zip(want, got):
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def test_a_stage_holds_kv_caches_for_its_layers_only(engines):
    whole, staged = engines("llama").engine, engines("llama", 2, 2).engine
    assert len(whole.executor.runner.kv_caches) == 3
    assert len(staged.executor.runner.kv_caches) == 2  # stage 0 of [2, 1]
    spec = staged.plan.shard
    assert kv_layout(spec, 2, pipeline_stage(3, 2, 1)).num_layers == 1
    # the block table is shared, so every stage has as many blocks; the largest stage's
    # layers (2, with half the KV heads per rank) bound a rank's bytes per block
    k = staged.executor.runner.kv_caches[0][0]
    assert k.shape[0] == staged.kv.num_blocks
    assert staged.kv.num_blocks == (1 << 22) // (2 * 2 * 1 * 16 * 16 * 4)


def test_ranks_are_numbered_stage_major_and_each_uses_its_stages_segments():
    from pyserve.executor.pipeline import PipelineLayout

    layout = PipelineLayout(tp_size=2, pp_size=2, base_name="/x", slot_bytes=64)
    assert [layout.position(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.memberships(0) == {"/x-tp0": (2, 0), "/x-hop0.0": (2, 0), "/x-logits": (2, 1)}
    assert layout.memberships(1) == {"/x-tp0": (2, 1), "/x-hop0.1": (2, 0)}
    assert layout.memberships(2) == {"/x-tp1": (2, 0), "/x-hop0.0": (2, 1), "/x-logits": (2, 0)}
    assert layout.memberships(3) == {"/x-tp1": (2, 1), "/x-hop0.1": (2, 1)}
    # every segment has exactly its number of ranks taking part
    for name, size in layout.segments().items():
        indices = sorted(m[name][1] for m in map(layout.memberships, range(4)) if name in m)
        assert indices == list(range(size)), name


def test_workers_start_per_rank_and_segments_are_unlinked(engines):
    llm = engines("llama", 2, 2)
    workers = llm.engine.executor.rank_pids[1:]
    assert len(workers) == 3 and all(alive(p) for p in workers)
    names = [p.name for p in llm.engine.executor.workers]
    assert names == ["pyserve-tp-rank1", "pyserve-tp-rank2", "pyserve-tp-rank3"]
    assert segments_of(os.getpid()) == []  # every segment unlinked once all ranks attached


def test_more_stages_than_layers_is_refused_at_start_up(models):
    with pytest.raises(ModelLoadError, match="leaves a stage with no layers: the model has 3"):
        LLM(str(models["llama"]), pipeline_parallel_size=4, kv_cache_memory=1 << 22)
    assert segments_of(os.getpid()) == []


def test_the_uni_backend_refuses_pipeline_parallelism(models):
    config = Config.from_flat(model=str(models["llama"]), pipeline_parallel_size=2,
                              distributed_executor_backend="uni")
    with pytest.raises(ModelLoadError, match="backend uni has no pipeline parallelism"):
        resolve(config)


def test_a_dead_stage_1_worker_fails_the_engine_and_shutdown_cleans_up(engines):
    """Last in the module for its engine: the kill ends it."""
    llm = engines("llama", 2, 2)
    del engines.started[("llama", 2, 2, 1)]  # this test shuts it down
    core = llm.engine
    reported = threading.Event()
    reasons = []
    core.on_executor_failure(lambda reason: (reasons.append(reason), reported.set()))
    pids = core.executor.rank_pids
    victim = pids[3]  # stage 1, tp rank 1: not the rank that sends the logits
    try:
        core.add_request("r", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
        core.step()
        os.kill(victim, signal.SIGKILL)
        assert reported.wait(30), "the worker's death was not reported"
        assert "pipeline-parallel worker pyserve-tp-rank3" in reasons[0] and str(victim) in reasons[0]
        with pytest.raises(RuntimeError, match="exited"):
            core.step()
    finally:
        llm.shutdown()
    for pid in pids[1:]:
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
    assert segments_of(os.getpid()) == []


def test_server_at_pp2_matches_offline_tp1_and_a_dead_stage_1_worker_ends_it(models, engines):
    import openai

    from tests.e2e.server import (ServerProcess, assert_books_balanced, child_pids, cmdline,
                                  kill_rank_mid_stream)

    model = str(models["llama"])
    prompts = ["The quick brown fox", "Paris is the capital of", "Numbers: 0 1 2"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in engines("llama").generate(prompts, params)]
    server = ServerProcess("--model", model, "--pipeline-parallel-size", "2",
                           "--kv-cache-memory", str(1 << 22))
    try:
        (worker,) = [p for p in child_pids(server.proc.pid) if "spawn_main" in cmdline(p)]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model=model, prompt=prompts, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
        assert_books_balanced(server.url)
        kill_rank_mid_stream(server, worker, model, prompts[0], 10, 30)  # the only worker: stage 1
    finally:
        server.stop()
    output = server.output()
    assert "pipeline-parallel worker" in output and "exited with code" in output
    assert "the engine died" in output
    assert segments_of(server.proc.pid) == []


def test_speculative_decoding_at_pp2_equals_plain_decoding(models, engines):
    """The drafts' verify rows are logits rows too: they come back from the last stage."""
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], [1, 7, 8, 7, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = [o.outputs[0].token_ids for o in engines("llama").generate(batch, params)]
    spec = LLM(str(models["llama"]), pipeline_parallel_size=2, kv_cache_memory=1 << 22,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1})
    try:
        got = [o.outputs[0].token_ids for o in spec.generate(batch, params)]
        assert spec.engine.stats.spec_drafts > 0
    finally:
        spec.shutdown()
    assert got == want
