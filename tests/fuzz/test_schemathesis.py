"""CI's short schemathesis run (tests/fuzz/run_schemathesis.py) against a real server on a tiny
random model: every operation of /openapi.json, a fixed seed, a few examples each (30 to 60 s
on two cores); no 5xx, answers that conform to the document, and the books balanced after."""

import sys

from tests.fuzz import run_schemathesis


def test_schemathesis_finds_nothing(tiny_model_factory, capfd):
    rc = run_schemathesis.main(["--model", str(tiny_model_factory("llama")), "--max-examples", "4",
                                "--seed", "1", "--phases", "examples,fuzzing", "--max-time", "60"])
    out = capfd.readouterr().out
    sys.stdout.write(out)  # shown with -s, and on failure
    assert rc == 0, out[-5000:]
