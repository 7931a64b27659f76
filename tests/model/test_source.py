"""A bad --model stops start-up with one clear message."""

import json
import shutil
import subprocess
import sys

import pytest

from pyserve.config import ModelConfig
from pyserve.errors import ModelLoadError
from pyserve.model.registry import SUPPORTED_ARCHITECTURES
from pyserve.model.source import resolve_model


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(ModelConfig(model="/nope/model"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(ModelConfig(model=str(tmp_path)))


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        resolve_model(ModelConfig(model=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="missing or has a bad value"):
        resolve_model(ModelConfig(model=str(tmp_path)))


def test_unsupported_architecture_lists_the_supported(tiny_model_factory, tmp_path):
    model = shutil.copytree(tiny_model_factory("llama"), tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(ModelConfig(model=str(model)))
    assert "GPT2LMHeadModel" in str(exc.value)
    assert all(a in str(exc.value) for a in SUPPORTED_ARCHITECTURES)


def test_missing_tokenizer_and_weights(tiny_model_factory, tmp_path):
    model = shutil.copytree(tiny_model_factory("llama"), tmp_path / "m")
    (model / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        resolve_model(ModelConfig(model=str(model)))
    for f in model.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(ModelConfig(model=str(model)))


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(ModelConfig(model=str(path)))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF-but-not-really")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        resolve_model(ModelConfig(model=str(fake), download_dir=str(tmp_path / "cache")))


def test_engine_refuses_lengths_it_cannot_hold(tiny_model_factory):
    from pyserve import LLM

    path = str(tiny_model_factory("llama"))
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        LLM(path, max_model_len=100000)
    with pytest.raises(ModelLoadError, match="--kv-cache-memory"):
        LLM(path, kv_cache_memory=10000)


def test_cli_prints_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    result = subprocess.run([sys.executable, "-m", "pyserve", "--model", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "not valid JSON" in result.stderr and "Traceback" not in result.stderr


def test_dummy_weights_need_no_checkpoint(tiny_model_factory, tmp_path):
    from pyserve import LLM, SamplingParams

    model = shutil.copytree(tiny_model_factory("qwen3"), tmp_path / "m")
    for f in model.glob("*.safetensors"):
        f.unlink()
    llm = LLM(str(model), load_format="dummy", kv_cache_memory="16MiB")
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def test_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(tiny_model_factory):
    from pyserve import LLM

    # 4 query heads, 2 KV heads, intermediate 128: 3 ranks cannot split them
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 3 does not divide the model's "
                                             "num_attention_heads"):
        LLM(str(tiny_model_factory("llama")), tensor_parallel_size=3)
