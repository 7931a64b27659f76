"""The Llama decoder's small families (models/smollm3.py, phi3.py, granite.py, olmo2.py): what
their config reading decides, Phi-3's fused tensors cut per tensor-parallel rank, Granite's
logits scaling in the logprobs, OLMo's refusal of split heads. Their greedy equality with
transformers is test_tiny_models.py's."""

import json

import pytest

from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch
from pyserve.model.models.smollm3 import nope_layers


def test_smollm3_reads_its_nope_layers(tiny_model_factory):
    cfg = json.loads((tiny_model_factory("smollm3") / "config.json").read_text())
    assert ModelArch.from_hf_config(cfg).family == (1, 3)  # its NoPE layers
    assert nope_layers({}, 8) == (3, 7)  # transformers' default: every fourth layer
    with pytest.raises(ModelLoadError, match="no_rope_layers"):
        nope_layers({"no_rope_layers": [1, 0]}, 3)


def test_phi3_fused_tensors_are_cut_per_rank(tiny_model_factory):
    from tests.executor.ranks import assert_split_equals_one_rank

    path = tiny_model_factory("phi3", True)  # sharded: the fused tensors arrive as slices
    assert_split_equals_one_rank(path, ["Hello, world!", "The quick brown fox jumps over"],
                                 tensor_parallel_size=2)


def test_a_partial_rotary_factor_is_refused_by_name(tiny_model_factory):
    cfg = json.loads((tiny_model_factory("phi3") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        ModelArch.from_hf_config({**cfg, "partial_rotary_factor": 0.75})


def test_granite_logprobs_are_transformers_with_its_logits_scaling(tiny_model_factory):
    # greedy ids (test_tiny_models.py) do not see a division of the logits; logprobs do
    import torch

    from pyserve import LLM, SamplingParams

    from .reference import load_hf

    path = tiny_model_factory("granite")
    out = LLM(str(path)).generate("The quick brown fox", SamplingParams(max_tokens=1, logprobs=5,
                                                                        temperature=0.0))[0]
    hf = load_hf(path)
    with torch.no_grad():
        logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    want = torch.log_softmax(logits, -1)
    for token, logprob in out.outputs[0].logprobs[0].items():
        assert logprob.logprob == pytest.approx(want[token].item(), abs=1e-4)


def test_olmo_q_k_norms_over_all_heads_refuse_tensor_parallel_ranks(tiny_model_factory):
    import torch

    from pyserve.model.layers.parallel import TPGroup
    from pyserve.model.models.olmo2 import Olmo2ForCausalLM

    cfg = json.loads((tiny_model_factory("olmo2") / "config.json").read_text())
    with pytest.raises(ValueError, match="one tensor-parallel rank"):
        Olmo2ForCausalLM(ModelArch.from_hf_config(cfg), 64, torch.float32, TPGroup(rank=0, size=2))


@pytest.mark.parametrize("key", ["mlp_bias", "attention_out_bias"])
def test_biases_the_layers_do_not_have_are_refused_by_name(tiny_model_factory, key):
    cfg = json.loads((tiny_model_factory("llama") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=key):
        ModelArch.from_hf_config({**cfg, key: True})


def test_ernie_use_bias_is_refused_by_name(tiny_model_factory):
    cfg = json.loads((tiny_model_factory("ernie4_5") / "config.json").read_text())
    assert ModelArch.from_hf_config(cfg).family is None
    with pytest.raises(ModelLoadError, match="use_bias"):
        ModelArch.from_hf_config({**cfg, "use_bias": True})
