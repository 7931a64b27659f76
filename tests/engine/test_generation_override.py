"""vLLM's --override-generation-config: laid over the model's generation_config.json defaults
(adding or replacing fields), applied with --generation-config vllm too, in the file's names
(max_new_tokens) or SamplingParams' (max_tokens); what is not a number of a known field is
ignored with a warning."""

import json
import logging

from pyserve import LLM
from pyserve.config import Config
from pyserve.engine.generation_defaults import load_generation_defaults


def _model_with(tmp_path, generation: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_override_replaces_and_adds_over_the_file(tmp_path):
    folder = _model_with(tmp_path, {"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 50})
    override = Config.from_flat(override_generation_config={"temperature": 0.5, "top_k": 3}).model
    defaults = load_generation_defaults("auto", folder, override.override_generation_config)
    assert defaults == {"temperature": 0.5, "top_p": 0.8, "max_tokens": 50, "top_k": 3}


def test_override_applies_with_generation_config_vllm(tmp_path):
    folder = _model_with(tmp_path, {"temperature": 0.7})
    assert load_generation_defaults("vllm", folder, (("max_new_tokens", 9),)) == {"max_tokens": 9}
    assert load_generation_defaults("vllm", folder, (("max_tokens", 9),)) == {"max_tokens": 9}
    assert load_generation_defaults("vllm", folder) == {}


def test_override_without_a_file_and_a_folder_setting(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    other = _model_with(tmp_path, {"top_p": 0.5})
    assert load_generation_defaults("auto", empty, (("temperature", 0.0),)) == {"temperature": 0.0}
    assert load_generation_defaults(str(other), empty, (("temperature", 0.0),)) == {
        "temperature": 0.0, "top_p": 0.5}


def test_unknown_or_non_numeric_items_are_ignored_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pyserve"):
        defaults = load_generation_defaults(
            "vllm", tmp_path, (("do_sample", True), ("temperature", "hot"), ("top_k", 5)))
    assert defaults == {"top_k": 5}
    assert sum("--override-generation-config" in r.getMessage() for r in caplog.records) == 2


def test_llm_takes_the_override(model_dir, tmp_path):
    """Through LLM(...) as through `serve --override-generation-config`: the engine core passes
    config.model.override_generation_config to load_generation_defaults."""
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", max_model_len=256, generation_config="vllm",
              override_generation_config={"temperature": 0.0, "max_new_tokens": 4})
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 4)
    finally:
        llm.shutdown()
