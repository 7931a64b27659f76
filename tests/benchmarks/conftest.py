import pytest


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    """The tiny random Llama (its own small byte-level BPE tokenizer)."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from benchmarks.datasets import load_tokenizer

    return load_tokenizer(str(tiny_dir))
