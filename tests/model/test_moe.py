"""Mixtures of experts (models/moe.py, layers/moe.py): the block against a plain loop over
tokens and their experts; tiny Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE models through preemption,
chunked prefill, prefix caching and n-gram speculation, equal to the plain run (their equality
with transformers is test_tiny_models.py's); served over a socket equal to offline; and the
refusals; tensor and pipeline parallelism equal to one rank. Issue 56."""

import json

import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch
from pyserve.model.layers.moe import MoeSpec, SparseMoe
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.models.moe import moe_spec

PROMPTS = ["Hello, world!", "The quick brown fox jumps over", "Paris is the capital of",
           "The capital of France is Paris. The capital of France is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def block(experts: int, top_k: int, norm: bool, shared: bool = False, hidden: int = 16,
          size: int = 8, seed: int = 0) -> SparseMoe:
    torch.manual_seed(seed)
    spec = MoeSpec(experts, top_k, size, norm, (True,))
    shared_mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden, bias=False)) if shared else None
    moe = SparseMoe(hidden, spec, torch.float32, shared_mlp)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def plain(moe: SparseMoe, x: torch.Tensor) -> torch.Tensor:
    """Each token, each of its chosen experts, one at a time, in float64."""
    probs = torch.softmax(x.double() @ moe.gate.weight.double().T, dim=-1)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    gate_up, down = moe.experts.gate_up_proj.double(), moe.experts.down_proj.double()
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist()):
            g, u = (gate_up[e] @ x[t].double()).chunk(2)
            out[t] += w * (down[e] @ (torch.nn.functional.silu(g) * u))
    if moe.shared_expert is not None:
        xd = x.double()
        out += torch.sigmoid(xd @ moe.shared_expert_gate.weight.double().T) * (
            xd @ moe.shared_expert[0].weight.double().T)
    return out


@pytest.mark.parametrize("experts,top_k,norm,shared,rows", [
    (8, 2, True, False, 1), (8, 2, False, True, 512), (4, 4, True, False, 7),  # top-k = E
    (16, 3, False, False, 33),
])
def test_the_block_equals_a_plain_loop_over_experts(experts, top_k, norm, shared, rows):
    moe = block(experts, top_k, norm, shared)
    x = torch.randn(rows, 16)
    torch.testing.assert_close(moe(x).double(), plain(moe, x), rtol=1e-5, atol=1e-5)


def test_an_expert_no_row_picks_and_one_every_row_picks():
    moe = block(8, 2, True)
    x = torch.randn(40, 16)
    x[:, 0] = 1.0
    with torch.no_grad():  # through the first feature, which every row holds as 1
        moe.gate.weight[3] = 0.0
        moe.gate.weight[3, 0] = 50.0  # first for every row
        moe.gate.weight[5] = 0.0
        moe.gate.weight[5, 0] = -50.0  # for none
    _, ids = moe.route(x)
    assert (ids == 3).any(-1).all() and not (ids == 5).any()
    torch.testing.assert_close(moe(x).double(), plain(moe, x), rtol=1e-5, atol=1e-5)


def test_routing_ties_pick_as_topk_does():
    moe = block(8, 2, True)
    with torch.no_grad():
        moe.gate.weight.zero_()  # every expert scores alike: torch.topk's order decides
    x = torch.randn(5, 16)
    _, ids = moe.route(x)
    assert ids.tolist() == [torch.topk(torch.full((8,), 0.125), 2).indices.tolist()] * 5
    torch.testing.assert_close(moe(x).double(), plain(moe, x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["qwen3moe", "qwen2moe", "mixtral", "olmoe"])
def moe_model(request, tiny_model_factory):
    return request.param, tiny_model_factory(request.param)


def test_preemption_chunks_prefix_caching_and_speculation_leave_outputs_unchanged(moe_model):
    arch, path = moe_model
    reference = [o.outputs[0].token_ids for o in LLM(str(path)).generate(PROMPTS, GREEDY)]
    cfg = json.loads((path / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = 2 * layers * kv_heads * head_dim * 16 * 4  # K+V, 16 tokens, float32
    tight = LLM(str(path), kv_cache_memory=6 * block_bytes, max_model_len=64, max_num_batched_tokens=3)
    assert tight.engine.kv.num_blocks == 6
    assert [o.outputs[0].token_ids for o in tight.generate(PROMPTS, GREEDY)] == reference
    assert tight.engine.scheduler.num_preemptions > 0
    # the prompts again: their prefixes come from the cache
    assert [o.outputs[0].token_ids for o in tight.generate(PROMPTS, GREEDY)] == reference
    spec = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, GREEDY)] == reference


def test_served_over_a_socket_equals_offline(tiny_model_factory):
    from tests.e2e.server import served_greedy_equals_offline

    path = tiny_model_factory("qwen3moe")
    offline = LLM(str(path)).generate(PROMPTS[:2], GREEDY)
    assert "8 experts, top-2" in served_greedy_equals_offline(path, offline, "moe", 32)


@pytest.mark.parametrize("arch,tp,pp", [("qwen2moe", 2, 1), ("qwen3moe", 1, 2), ("mixtral", 2, 1)])
def test_tensor_and_pipeline_parallel_equal_one_rank(tiny_model_factory, arch, tp, pp):
    """Each expert's intermediate size split over two ranks (the shared expert's too), or the
    layers over two stages (Qwen3-MoE's dense middle layer on the first): the same greedy ids
    and logprobs to float32 reduction noise."""
    from tests.executor.ranks import assert_split_equals_one_rank

    path = tiny_model_factory(arch, arch == "mixtral")  # sharded: each rank narrows the slices
    assert_split_equals_one_rank(path, PROMPTS, tensor_parallel_size=tp, pipeline_parallel_size=pp)


def test_expert_layouts_it_cannot_run_are_refused_by_name(tiny_model_factory):
    cfg = json.loads((tiny_model_factory("qwen3moe") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        moe_spec("Qwen3MoeForCausalLM", {**cfg, "num_experts_per_tok": 9}, 3)
    with pytest.raises(ModelLoadError, match="clip_qkv"):
        moe_spec("OlmoeForCausalLM", {**cfg, "clip_qkv": 8.0}, 3)
    arch = ModelArch.from_hf_config(cfg)
    with pytest.raises(ValueError, match="experts' intermediate size"):  # 32 over 3 ranks
        SparseMoe(64, arch.moe, torch.float32, tp=TPGroup(rank=0, size=3))
