"""Hybrid linear attention (models/qwen3_next.py, layers/linear_attention.py): the gated delta
rule in chunks against transformers' own PyTorch references; tiny Qwen3.5, Qwen3.5-MoE and
Qwen3-Next models (their equality with transformers is test_tiny_models.py's) through small
chunks, preemption, mixed batches and seeded n = 3, equal to the plain run; the state pool's
slots given back; served over a socket; and the refusals. Issue 57."""

import json

import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.engine.books import problems
from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch
from pyserve.model.layers.linear_attention import (causal_conv, chunked_delta_rule,
                                                   recurrent_delta_rule, recurrent_delta_rule_)

from .reference import hf_greedy, load_hf

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys",
           "Paris", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100. Tokyo is the capital of Japan. Python"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _inputs(n: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 2  # log decays
    beta = torch.rand(n, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state):
    """transformers' token-by-token reference of the gated delta rule."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    out, final = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                  initial_state=state[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


@pytest.mark.parametrize("n", [1, 5, 64, 100, 129])  # one token, within, at, across chunks of 64
def test_chunked_delta_rule_equals_the_token_loop(n):
    q, k, v, g, beta, state = _inputs(n, seed=n)
    out, final = chunked_delta_rule(q, k, v, g, beta, state)
    expected, expected_final = _reference(q, k, v, g, beta, state)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(final, expected_final, rtol=1e-5, atol=2e-6)


def test_a_state_stored_and_resumed_continues_the_sequence():
    """A prompt in pieces (37, 1, 62 tokens: a piece of one token, and a split inside a chunk),
    each piece resuming from the state the last one left, then decode steps by the recurrent
    update: the outputs of the whole prompt at once, and its final state."""
    q, k, v, g, beta, state = _inputs(103, seed=7)
    expected, expected_final = _reference(q, k, v, g, beta, state)
    outs, s = [], state
    for a, b in ((0, 37), (37, 38), (38, 100)):
        out, s = chunked_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        outs.append(out)
    s = s.unsqueeze(0)
    for t in range(100, 103):
        out, s = recurrent_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(s[0], expected_final, rtol=1e-5, atol=2e-6)


def test_recurrent_step_updates_the_slot_in_place():
    """Decode's step on a view of the pool (recurrent_delta_rule_): the slot itself holds the
    state after it, transformers' step to float32 rounding, and the other slots are untouched."""
    q, k, v, g, beta, state = _inputs(1, seed=3)
    pool = torch.randn(3, *state.shape)
    pool[1] = state
    before = pool.clone()
    out = recurrent_delta_rule_(q, k, v, g, beta, pool[1:2])
    expected, expected_final = _reference(q, k, v, g, beta, state)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[1], expected_final, rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])


def test_causal_conv_carries_its_window():
    """The convolution of a sequence in two pieces, the second after the first's last K - 1
    inputs, equals it whole (zeros before the start, as transformers pads)."""
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(11, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole, _ = causal_conv(x, torch.zeros(6, 3), weight)
    expected = torch.nn.functional.silu(torch.nn.functional.conv1d(
        x.t()[None], weight[:, None], padding=3, groups=6)[0, :, :11]).t()
    torch.testing.assert_close(whole, expected)
    first, window = causal_conv(x[:4], torch.zeros(6, 3), weight)
    second, _ = causal_conv(x[4:], window, weight)
    torch.testing.assert_close(torch.cat([first, second]), whole)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5moe", "qwen3next"])
def hybrid_model(request, tiny_model_factory):
    return request.param, tiny_model_factory(request.param)


def test_chunks_preemption_and_batches_leave_outputs_unchanged(hybrid_model):
    """Steps of 3 tokens (every prompt in several chunks, its state carried between them); a KV
    cache of 5 blocks, so that requests are preempted and computed again from their first
    token; each prompt alone: all as the plain run. Every state slot is back at the end."""
    arch, path = hybrid_model
    plain = LLM(str(path))
    reference = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    for prompt, expected in zip(PROMPTS, reference):
        assert plain.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    cfg = json.loads((path / "config.json").read_text())
    arch = ModelArch.from_hf_config(cfg)
    block_bytes = 2 * arch.num_kv_layers * cfg["num_key_value_heads"] * cfg["head_dim"] * 16 * 4
    state_bytes = 2 * arch.family.state_bytes(torch.float32)  # two rows, off the same budget
    tight = LLM(str(path), kv_cache_memory=5 * block_bytes + state_bytes, max_model_len=64,
                max_num_batched_tokens=3, max_num_seqs=2, enable_prefix_caching=False)
    assert tight.engine.kv.num_blocks == 5
    longer = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)  # 3 or 4 blocks each
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, longer)]
    assert [o.outputs[0].token_ids for o in tight.generate(PROMPTS, longer)] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    kv = tight.engine.kv
    assert kv.state.num_free_slots == kv.state.num_slots == 2 and kv.num_tracked_requests() == 0


def test_prefix_hits_resume_from_state_checkpoints(hybrid_model):
    """Prompts that share a prefix with finished ones (the same prompt again, one longer, one
    that leaves it mid-block): their cached blocks end on a checkpoint of the linear state, the
    request resumes there, and every output is the one prefix caching off gives."""
    arch, path = hybrid_model
    shared = PROMPTS[1] + " " + PROMPTS[3]  # about 45 tokens: two full blocks and a part
    prompts = [shared, shared + " Paris is the capital of France.", shared, shared[:120] + " Tokyo"]
    off = LLM(str(path), enable_prefix_caching=False, max_num_batched_tokens=16)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY)]
    on = LLM(str(path), max_num_batched_tokens=16)  # checkpoints every 16 tokens: each block
    got = [on.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    kv = on.engine.kv
    assert kv.state.checkpoint_hits >= 3 and kv.prefix_hits > 0 and kv.num_tracked_requests() == 0
    books = on.engine.books()  # every row and checkpoint given back; checkpoints kept
    assert not problems(books) and books["state_checkpoints_kept"] > 0
    assert books["state_slots_referenced"] == books["state_checkpoints_held"] == 0


def test_n_seeded_equals_single_requests(tiny_model_factory):
    """n = 3 with a seed: the three children (seeds s, s + 1, s + 2), each with its own state
    slot, as three requests alone."""
    llm = LLM(str(tiny_model_factory("qwen3_5")))
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=11, n=3)
    together = [c.token_ids for c in llm.generate(PROMPTS[1], sampled)[0].outputs]
    alone = [llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True,
                                                     seed=11 + i))[0].outputs[0].token_ids for i in range(3)]
    assert together == alone and len({tuple(t) for t in together}) > 1


def test_beam_search_resumes_each_round_from_checkpoints(tiny_model_factory):
    """Each round's beams are requests over the prompt and their tokens so far: they resume
    from the checkpoints of their shared prefixes, and find the beams prefix caching off finds."""
    from pyserve.sampling_params import BeamSearchParams

    path = str(tiny_model_factory("qwen3next"))
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    on, off = LLM(path, max_num_batched_tokens=16), LLM(path, enable_prefix_caching=False)
    beams = lambda llm: [(s.tokens, s.cum_logprob) for s in llm.beam_search([PROMPTS[1]], params)[0].sequences]
    with_cache, without = beams(on), beams(off)
    assert [t for t, _ in with_cache] == [t for t, _ in without] and len(with_cache) == 3
    assert on.engine.kv.state.checkpoint_hits > 0


def test_fewer_slots_than_sequences_queue_the_rest(tiny_model_factory):
    """A state pool that holds two sequences: eight requests run two at a time, each as alone."""
    path = tiny_model_factory("qwen3next")
    reference = [o.outputs[0].token_ids for o in LLM(str(path)).generate(PROMPTS, GREEDY)]
    llm = LLM(str(path), max_num_seqs=2)
    assert llm.engine.kv.state.num_slots == 2
    outs = llm.generate(PROMPTS * 2, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference * 2


def test_served_over_a_socket_equals_offline(tiny_model_factory):
    """Through the server (async scheduling: decode steps prepared from the last one)."""
    from tests.e2e.server import served_greedy_equals_offline

    path = tiny_model_factory("qwen3_5moe")
    offline = LLM(str(path)).generate(PROMPTS[:2], GREEDY)
    log = served_greedy_equals_offline(path, offline, "hybrid", 24)
    assert "3 linear-attention layers" in log and "prefix-cache checkpoints" in log


def test_what_it_cannot_do_is_refused_by_name(tiny_model_factory):
    path = str(tiny_model_factory("qwen3_5"))
    with pytest.raises(ModelLoadError, match="roll back"):
        LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                      "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 1"):
        LLM(path, tensor_parallel_size=2)
    cfg = json.loads((tiny_model_factory("qwen3_5") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="layer_types"):
        ModelArch.from_hf_config({**cfg, "layer_types": ["linear_attention", "sliding_attention"] * 2})
    with pytest.raises(ModelLoadError, match="multiple of linear_num_key_heads"):
        ModelArch.from_hf_config({**cfg, "linear_num_value_heads": 3})


@pytest.fixture(scope="module")
def converted(default_model_dir, tmp_path_factory):
    """Tiny hybrids written by llama.cpp's own converter (SmolLM2's tokenizer: it refuses BPE
    pre-tokenizers it does not know): a dense Qwen3.5 in F32 and Q8_0 (its value heads tiled,
    two per key head), and a Qwen3-Next whose every layer is MoE (the layout it converts)."""
    from llamacpp_convert import convert
    from make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("hybrid-gguf")
    made = {}
    for arch in ("qwen3_5", "qwen3next-moe"):
        model_dir = make_tiny_model(root / arch, arch, tokenizer_from=default_model_dir)
        made[arch] = model_dir, convert(model_dir, root / f"{arch}.gguf", "f32", ("--no-mtp",))
    made["qwen3_5-q8"] = made["qwen3_5"][0], convert(made["qwen3_5"][0], root / "q8.gguf", "q8_0", ("--no-mtp",))
    return made


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen3_5", "qwen3next-moe"])
def test_gguf_written_by_llamacpp_decodes_as_transformers(converted, which, tmp_path):
    """The F32 file (norms stored as 1 + w, A as -exp(A_log), Qwen3.5's value heads tiled,
    Qwen3-Next's b and a merged per key head) read in place: greedy ids as transformers on the
    original checkpoint, and on the reference checkpoint convert_gguf makes of the file."""
    from pyserve.model.gguf import convert_gguf

    model_dir, gguf_file = converted[which]
    prompts = ["The quick brown fox jumps over the lazy dog and then it runs far away", "Paris is"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = LLM(str(gguf_file), download_dir=str(tmp_path), max_num_batched_tokens=8).generate(prompts, params)
    reference = convert_gguf(gguf_file, tmp_path / "reference")
    for directory in (model_dir, reference):
        hf = load_hf(directory)
        for out in outs:
            assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24)


@pytest.mark.slow
def test_quantized_gguf_equals_transformers_on_its_dequantized_weights(converted, tmp_path):
    """Q8_0 linear layers kept in their blocks (the projections' packed kernels): greedy ids as
    transformers on the file's dequantized weights."""
    from pyserve.model.gguf import convert_gguf

    _, gguf_file = converted["qwen3_5-q8"]
    llm = LLM(str(gguf_file), download_dir=str(tmp_path))
    layer = llm.engine.executor.runner.model.model.layers[0].linear_attn
    assert layer.in_proj_qkvz.packed is not None and layer.out_proj.packed is not None  # Q8_0 blocks
    assert layer.spec.tiled_value_heads
    prompts = ["Once upon a time there was a", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    hf = load_hf(convert_gguf(gguf_file, tmp_path / "reference"))
    for out in llm.generate(prompts, params):
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24)
