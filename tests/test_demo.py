"""`python -m pyserve` with no flags: the default model answers a chat question."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_default_command_answers_coherently(default_model_dir):
    result = subprocess.run([sys.executable, "-m", "pyserve"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "KV cache:" in result.stderr  # start-up logs the cache size
