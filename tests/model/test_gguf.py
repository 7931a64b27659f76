"""GGUF files: the float32 conversion (the tests' reference checkpoint) holds exactly the
tensors transformers computes when it loads the GGUF itself and generates the same greedy ids;
--model FILE.gguf reads the file in place and computes what that checkpoint computes."""

import pytest
import torch
from safetensors.torch import load_file

from pyserve import LLM, SamplingParams, _native
from pyserve.cli import parse_config
from pyserve.model.default_model import fetch_default_gguf

from .reference import hf_greedy, load_hf

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The capital of Japan is"]


@pytest.fixture(scope="module")
def gguf_file(default_model_dir):
    return fetch_default_gguf(parse_config([]).model.download_dir)


@pytest.fixture(scope="module")
def hf_from_gguf(gguf_file):
    return load_hf(gguf_file.parent, gguf_file=gguf_file.name)


def test_converted_tensors_equal_transformers_gguf_load(default_model_dir, hf_from_gguf):
    ours = load_file(str(default_model_dir / "model.safetensors"))
    theirs = hf_from_gguf.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_greedy_output_equals_transformers_on_the_gguf(default_model_dir, hf_from_gguf, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    converted = LLM(str(default_model_dir)).generate(PROMPTS, params)
    for out in converted:
        assert out.outputs[0].token_ids == hf_greedy(hf_from_gguf, out.prompt_token_ids, 48)


def test_model_flag_accepts_a_gguf_file(default_model_dir, gguf_file, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    direct = LLM(str(gguf_file), download_dir=str(tmp_path)).generate(PROMPTS, params)
    converted = LLM(str(default_model_dir)).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in direct] == [o.outputs[0].token_ids for o in converted]
    # read in place: the directory made for the file holds its config and tokenizer, no weights
    (made,) = tmp_path.glob("converted/*")
    assert (made / "config.json").exists() and not any(made.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in made.iterdir()) < gguf_file.stat().st_size / 10


def test_gguf_weights_stay_quantized_and_compute_exactly_as_float32(default_model_dir, gguf_file):
    """--model FILE.gguf keeps the file's Q4_1 / Q8_0 blocks (a sixth of float32's bytes) and
    the kernel dequantizes them exactly as the conversion did: sampled and prompt logprobs are
    bitwise the float32 checkpoint's, for decode steps and for a prefill of more rows than
    the packed kernel takes (which widens the blocks for BLAS)."""
    from pyserve.model.layers.linear import QUANTIZED_PACKED_MAX_ROWS
    from pyserve.model.layers.quantized import BLOCK_BYTES

    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)  # > 512 tokens
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    quantized = LLM(str(gguf_file), max_num_batched_tokens=1024)
    model = quantized.engine.executor.runner.model
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.packed.dtype == torch.uint8  # Q4_1 panels
    assert model.model.embed_tokens.packed.dtype == torch.uint8  # Q8_0 panels
    assert layer.mlp.gate_up_proj.weight.numel() == 0  # no float copy kept
    packed_bytes = sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                       if getattr(m, "packed", None) is not None)
    assert packed_bytes < 135e6 * 4 / 5 and {"Q4_1", "Q8_0"} <= set(BLOCK_BYTES)
    float32 = LLM(str(default_model_dir), max_num_batched_tokens=1024)  # the same chunks
    prompts = PROMPTS + [long_prompt]
    ours = quantized.generate(prompts, params)
    reference = float32.generate(prompts, params)
    assert len(quantized.engine.tokenizer.encode(long_prompt)) > QUANTIZED_PACKED_MAX_ROWS
    for a, b in zip(ours, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.prompt_logprobs == b.prompt_logprobs


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="needs AVX2 or AVX-512 VNNI")
def test_int8_activations_stay_close_to_the_exact_output(gguf_file):
    """--gguf-activations int8 quantizes the Q4_1 layers' inputs (llama.cpp's arithmetic): not
    bitwise, so held to closeness on the exact mode's own greedy tokens (teacher forcing). The
    bounds sit well outside what the default model measures (benchmarks.int8_accuracy: 94% top-1
    agreement, mean |Δ logprob| 0.07 over 640 positions) and well inside what a broken kernel
    gives (near-random ranks)."""
    from benchmarks.int8_accuracy import PROMPTS as ACCURACY_PROMPTS, measure

    fast = LLM(str(gguf_file), gguf_activations="int8")
    layer = fast.engine.executor.runner.model.model.layers[0]
    assert layer.mlp.gate_up_proj.packed.dtype == torch.int8  # marked for integer dot products
    assert fast.engine.executor.runner.model.model.embed_tokens.packed.dtype == torch.int8  # Q8_0 too
    del fast
    result = measure(str(gguf_file), ACCURACY_PROMPTS[:6], 32)
    assert result.top1_agree / result.positions > 0.85, result.describe()
    assert result.mean_abs_delta < 0.2, result.describe()
    assert max(result.greedy_common) >= 16, result.describe()


def test_llama3_rope_scaling_written_by_llamacpp_is_read(tiny_model_factory, default_model_dir, tmp_path):
    """llama.cpp's converter writes Llama 3's rope scaling only as the tensor rope_freqs.weight
    (no metadata): read, the GGUF decodes as the safetensors directory does under
    transformers (before, the scaling was dropped and the rope was the unscaled one)."""
    from llamacpp_convert import convert
    from make_tiny_model import make_tiny_model

    from pyserve.model.gguf import _config

    # SmolLM2's tokenizer: the converter refuses BPE pre-tokenizers it does not know
    model_dir = make_tiny_model(tmp_path / "llama3", "llama3", tokenizer_from=default_model_dir)
    gguf_file = convert(model_dir, tmp_path / "llama3.gguf")
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}
    assert not any("rope.scaling" in key for key in reader.fields)
    cfg, _ = _config(reader)
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = load_hf(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The quick brown fox jumps over the lazy dog and then it runs far away", "Paris is"]
    outs = LLM(str(gguf_file), download_dir=str(tmp_path / "cache")).generate(prompts, params)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24)


def test_yarn_rope_scaling_written_by_llamacpp_is_read(default_model_dir, tmp_path):
    """A Qwen3 with YaRN (llama.cpp writes it as metadata): the GGUF decodes as transformers
    decodes the safetensors directory."""
    from gguf import GGUFReader
    from llamacpp_convert import convert
    from make_tiny_model import make_tiny_model

    from pyserve.model.gguf import _config

    model_dir = make_tiny_model(tmp_path / "yarn", "qwen3-yarn", tokenizer_from=default_model_dir)
    gguf_file = convert(model_dir, tmp_path / "yarn.gguf")
    cfg, _ = _config(GGUFReader(gguf_file))
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 4.0
    hf = load_hf(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The quick brown fox jumps over the lazy dog and then it runs far away", "Paris is"]
    for out in LLM(str(gguf_file), download_dir=str(tmp_path / "cache")).generate(prompts, params):
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24)


def test_rope_freqs_that_no_llama3_scaling_gives_are_applied_as_divisors():
    from pyserve.model.gguf import _scaling_from_rope_freqs
    from pyserve.model.layers.rotary import RotaryEmbedding, _inv_freq, llama3_factors

    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert _scaling_from_rope_freqs(llama3_factors(128, 500000.0, llama3).float(), 128, 500000.0) == llama3
    assert _scaling_from_rope_freqs(torch.ones(64), 128, 500000.0) is None
    odd = torch.linspace(1.0, 3.0, 8)  # no Llama 3 scaling has these
    scaling = _scaling_from_rope_freqs(odd, 16, 10000.0)
    assert scaling["rope_type"] == "rope_freqs"
    rope = RotaryEmbedding(16, 32, 10000.0, scaling)
    expected = torch.arange(32.0)[:, None] * (_inv_freq(16, 10000.0) / odd)[None, :]
    assert torch.equal(rope.cos, expected.cos())
    with pytest.raises(Exception, match="rope_freqs.weight holds 3 factors"):
        _scaling_from_rope_freqs(torch.ones(3), 16, 10000.0)
