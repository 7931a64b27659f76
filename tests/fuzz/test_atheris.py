"""CI's short atheris runs of the coverage-guided targets (tests/fuzz/fuzz_http.py,
tests/fuzz/fuzz_requests.py, tests/fuzz/fuzz_model_text.py), each in a subprocess: a fixed
seed, a bounded number of runs and a time cap; libFuzzer exits non-zero on the first input that
breaks a property."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.fuzz_http import seed_corpus

ROOT = Path(__file__).resolve().parents[2]
RUNS, SECONDS = 20000, 45


def fuzz(module: str, corpus: Path, *extra: str) -> tuple[int, str]:
    # libFuzzer's RSS limit reads the process's peak RSS, which Linux carries over exec from
    # the forking process (pytest, holding models by now): it is off, and one allocation of
    # 2 GiB or more still counts as a finding
    command = [sys.executable, "-m", module, f"-runs={RUNS}", "-seed=1",
               f"-max_total_time={SECONDS}", "-rss_limit_mb=0", "-malloc_limit_mb=2048",
               f"-artifact_prefix={corpus}/crash-", str(corpus), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SECONDS + 120)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("module", ["tests.fuzz.fuzz_http", "tests.fuzz.fuzz_requests",
                                    "tests.fuzz.fuzz_model_text"])
def test_atheris_target_finds_nothing(module, tmp_path, tiny_model_factory):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    extra = ()
    if module.endswith("fuzz_http"):
        seed_corpus(corpus)
    elif module.endswith("fuzz_requests"):
        extra = ("--", "--model", str(tiny_model_factory("llama")))
    rc, output = fuzz(module, corpus, *extra)
    runs = re.search(r"Done (\d+) runs in (\d+) second", output)
    assert rc == 0 and runs is not None, output[-6000:]
    edges = re.findall(r"cov: (\d+)", output)[-1]
    print(f"{module}: {runs[1]} executions in {runs[2]} s, {edges} edges covered")
    assert int(runs[1]) >= 1000  # the target ran for real, not once
