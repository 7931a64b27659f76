"""Beam search (engine/beam_search.py): its selection core on hand-made logprobs, then
LLM.beam_search through the real engine against a reference written here from vLLM's algorithm
(vllm/entrypoints/openai BeamSearchOnlineMixin / LLM.beam_search, vllm/beam_search.py) on
transformers' logits for the same tiny random weights: same sequences, cum_logprobs within 1e-4.
(transformers' own generate(num_beams=...) stops and scores differently: early_stopping and a
per-hypothesis length without the prompt.)"""

import math

import pytest
import torch

from pyserve import LLM
from pyserve.engine.beam_search import BeamSearch, get_beam_search_score, select
from pyserve.engine.output import Logprob
from pyserve.errors import InvalidRequest
from pyserve.sampling_params import BeamSearchParams

EOS = 2


def pos(**logprobs) -> dict:
    """A position's logprobs from t<id>=logprob keywords, ranked in the order given."""
    return {int(k[1:]): Logprob(v, r) for r, (k, v) in enumerate(logprobs.items(), 1)}


# -- the selection core --------------------------------------------------------------------------
def test_select_keeps_the_best_by_cumulative_logprob_ties_in_order():
    cands = [(-1.0, 5, None, None), (-0.5, 6, None, None), (-1.0, 7, None, None), (-3.0, 8, None, None)]
    assert [c[1] for c in select(cands, 3)] == [6, 5, 7]
    assert select([], 2) == []


def test_score_counts_the_prompt_and_not_a_final_eos():
    assert get_beam_search_score([1, 2, 3, 4], -2.0, EOS, 1.0) == -0.5
    assert get_beam_search_score([1, 3, 4, EOS], -3.0, EOS, 1.0) == -1.0
    assert get_beam_search_score([1, 3], -2.0, EOS, 0.0) == -2.0
    assert get_beam_search_score([1, 3, 4, 5], -2.0, EOS, 2.0) == -2.0 / 16


def test_a_round_expands_every_beam_and_keeps_the_width_best():
    search = BeamSearch([1, 9], BeamSearchParams(beam_width=2, max_tokens=3), EOS, 64)
    search.advance([pos(t5=-0.1, t6=-0.2, t7=-3.0)])
    assert [(b.tokens, b.cum_logprob) for b in search.beams] == [([1, 9, 5], -0.1), ([1, 9, 6], -0.2)]
    # the second beam's children beat the first's
    search.advance([pos(t3=-2.0, t4=-2.5), pos(t3=-0.1, t8=-0.3)])
    assert [b.tokens[2:] for b in search.beams] == [[6, 3], [6, 8]]
    assert math.isclose(search.beams[0].cum_logprob, -0.3)
    assert all(b.logprobs[-1] is not None for b in search.beams)


def test_eos_finishes_a_beam_however_it_ranks_and_ignore_eos_keeps_it_going():
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=4), EOS, 64)
    search.advance([pos(t5=-0.1, t2=-5.0)])
    assert [b.tokens for b in search.beams] == [[1, 5]]
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in search.completed] == [([1, 2], "stop", EOS)]
    ignoring = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True), EOS, 64)
    ignoring.advance([pos(t5=-0.1, t2=-0.2)])
    assert [b.tokens for b in ignoring.beams] == [[1, 5], [1, 2]] and not ignoring.completed


def test_the_end_ranks_finished_beams_by_length_penalised_score():
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    search = BeamSearch([1, 1], params, EOS, 64)
    search.advance([pos(t5=-1.0, t2=-1.2, t6=-4.0)])  # [1 1 2] done: score -1.2 / 2
    search.advance([pos(t7=-0.1, t8=-0.2), pos(t7=-0.3, t8=-0.4)])  # length: -1.1 / 4 best
    assert search.finished
    best = search.best()
    assert [b.tokens for b in best] == [[1, 1, 5, 7], [1, 1, 5, 8]]
    assert [b.finish_reason for b in best] == ["length", "length"]
    # no length penalty: the short EOS beam wins on raw cumulative logprob
    search = BeamSearch([1, 1], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0), EOS, 64)
    search.advance([pos(t5=-1.0, t2=-1.05, t6=-4.0)])
    search.advance([pos(t7=-0.1, t8=-0.2), pos(t7=-0.3, t8=-0.4)])
    assert [b.tokens for b in search.best()] == [[1, 1, 2], [1, 1, 5, 7]]


def test_model_length_caps_the_rounds_and_an_abort_ends_the_search():
    search = BeamSearch([1, 1, 1], BeamSearchParams(beam_width=1, max_tokens=50), EOS, 5)
    assert search.max_tokens == 2
    search.advance([pos(t5=-1.0)])
    search.advance([pos(t5=-1.0)])
    assert search.finished and search.best()[0].tokens == [1, 1, 1, 5, 5]
    aborted = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=5), EOS, 64)
    aborted.advance([pos(t5=-1.0, t6=-2.0)])
    aborted.advance([pos(t5=-1.0), None])
    assert aborted.finished and {b.finish_reason for b in aborted.best()} == {"abort"}


def test_stop_tokens_and_stop_strings_finish_beams():
    params = BeamSearchParams(beam_width=2, max_tokens=5, stop_token_ids=(7,))
    stop_on_8 = lambda beam: "eight" if beam.tokens[-1] == 8 else None  # noqa: E731
    search = BeamSearch([1], params, EOS, 64, stop_check=stop_on_8)
    search.advance([pos(t7=-0.1, t8=-0.2, t5=-0.3, t6=-0.4)])
    assert [(b.tokens, b.stop_reason) for b in search.completed] == [([1, 7], 7), ([1, 8], "eight")]
    assert [b.tokens for b in search.beams] == [[1, 5]]  # the stop string took a live slot


def test_params_name_what_is_wrong():
    with pytest.raises(InvalidRequest) as e:
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert e.value.param == "n"
    with pytest.raises(InvalidRequest):
        BeamSearchParams(beam_width=2, max_tokens=0)


# -- through the engine, against a reference on transformers' logits ---------------------------
PROMPTS = ["Hello, world!", "Paris is the capital of", "0 1 2 3"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=64)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


@torch.no_grad()
def reference(hf, prompt_ids, width, max_tokens, eos, ignore_eos=False, length_penalty=1.0):
    """vLLM's beam search, spelled out: (tokens, cum_logprob) of the best beams."""
    beams, completed = [(list(prompt_ids), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            logprobs = hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                if token == eos and not ignore_eos:
                    completed.append((tokens + [token], cum + lp))
                else:
                    candidates.append((cum + lp, token, tokens))
        candidates.sort(key=lambda c: -c[0])
        beams = [(tokens + [token], cum) for cum, token, tokens in candidates[:width]]
        if not beams:
            break
    completed += beams

    def score(beam):
        tokens, cum = beam
        return cum / ((len(tokens) - (tokens[-1] == eos)) ** length_penalty)
    return sorted(completed, key=score, reverse=True)[:width]


def assert_same(outputs, expected):
    got = [(s.tokens, s.cum_logprob) for s in outputs.sequences]
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert abs(a - b) < 1e-4, (a, b)


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beam_search_matches_the_reference(llm, hf, width, length_penalty):
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        assert len(out.sequences) == width
        assert_same(out, reference(hf, ids, width, 10, tok.eos_token_id, False, length_penalty))
        for seq in out.sequences:  # vLLM's offline shape: the whole sequence, decoded
            assert seq.tokens[:len(ids)] == ids and seq.text == tok.decode(seq.tokens)
            assert len(seq.logprobs) == len(seq.tokens) - len(ids)


def test_beams_that_end_on_eos_match_the_reference(llm, hf):
    """The tiny model rarely writes its EOS: a token the beams do write stands in for it (the
    tokenizer's eos, which beam search reads, as vLLM's), so beams finish early."""
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[0])
    first = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=8))[0]
    stand_in = first.sequences[0].tokens[len(ids) + 2]
    saved = tok.eos_token_id
    tok.eos_token_id = stand_in
    try:
        for lp in (1.0, 0.0, 2.0):
            out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=8,
                                                               length_penalty=lp))[0]
            assert_same(out, reference(hf, ids, 3, 8, stand_in, False, lp))
            stopped = [s for s in out.sequences if s.finish_reason == "stop"]
            assert all(s.tokens[-1] == stand_in and s.stop_reason == stand_in for s in stopped)
            assert stopped or lp == 2.0  # a strong length penalty favours the long beams
        kept = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))[0]
        assert_same(kept, reference(hf, ids, 3, 8, stand_in, True))
    finally:
        tok.eos_token_id = saved


def test_refusals_and_no_leaked_blocks(llm):
    free = llm.engine.kv.num_free_blocks
    with pytest.raises(InvalidRequest) as e:
        llm.beam_search("Hi", BeamSearchParams(beam_width=11, max_tokens=4))  # 22 > max_logprobs 20
    assert e.value.param == "n"
    with pytest.raises(InvalidRequest):
        llm.beam_search("Hi", BeamSearchParams(beam_width=2, max_tokens=100))  # past max_model_len
    llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=6), concurrency_limit=2)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_blocks == free
