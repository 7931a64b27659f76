import pytest


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    """The tiny random Llama most engine tests run on (a module may override it)."""
    return tiny_model_factory("llama")
