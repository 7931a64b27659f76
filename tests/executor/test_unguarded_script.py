"""LLM(..., tensor_parallel_size=2) at the top level of a script without
`if __name__ == "__main__":` fails with one sentence saying so: the spawned worker imports the
script again, and instead of multiprocessing's RuntimeError about the bootstrapping phase (and
a traceback from each process) the worker exits quietly and the parent raises the sentence."""

import subprocess
import sys

SCRIPT = """\
from pyserve import LLM
llm = LLM({model!r}, tensor_parallel_size=2, kv_cache_memory=1 << 22)
print("generated", llm.generate([[1, 2, 3]])[0].outputs[0].token_ids)
"""

GUARDED = """\
from pyserve import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM({model!r}, tensor_parallel_size=2, kv_cache_memory=1 << 22)
    print("generated", llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids)
"""


def _run(tmp_path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_unguarded_script_fails_with_one_sentence(tiny_model_factory, tmp_path):
    done = _run(tmp_path, SCRIPT.format(model=str(tiny_model_factory("llama"))))
    assert done.returncode == 1 and "generated" not in done.stdout
    err = done.stderr
    assert "bootstrapping phase" not in err and "multiprocessing" not in err
    assert "RuntimeError" not in err  # neither the child's nor the aborted communicator's
    assert err.count('if __name__ == "__main__":') == 1
    last = err.strip().splitlines()[-1]
    assert "ModelLoadError: tensor-parallel start-up failed: tensor_parallel_size > 1" in last


def test_guarded_script_runs(tiny_model_factory, tmp_path):
    done = _run(tmp_path, GUARDED.format(model=str(tiny_model_factory("llama"))))
    assert done.returncode == 0, done.stderr
    assert "generated [" in done.stdout
