"""lm-evaluation-harness (pinned in installs.py, its own environment) against pyserve,
offline. A small local multiple-choice task is scored through `local-completions`, whose
loglikelihoods come from pyserve's `echo` + `logprobs` on the token ids lm-eval sends, and
through `--model hf` (transformers) on the same weights: each choice's loglikelihood agrees
within TOLERANCE, whether it is the greedy continuation agrees, and so does the accuracy. One
generate_until item goes through `local-chat-completions`."""

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.server import ServerProcess

from .installs import python_client

pytestmark = pytest.mark.clients
# float32 on both sides, different kernels (pyserve's attention and GEMMs against PyTorch's):
# a continuation's summed loglikelihood of a few tokens differs by ~1e-5; the bound leaves room
TOLERANCE = 1e-3
ITEMS = [("The capital of France is", [" Paris.", " Tokyo.", " a dog."], 0),
         ("Continuous batching lets requests", [" join and leave.", " stop.", " 42"], 0),
         ("Hello, world! How are", [" you today?", " the numbers?", " fine"], 0),
         ("A paged KV cache stores keys and", [" values.", " dogs.", " Paris"], 0),
         ("The quick brown fox jumps over the", [" lazy dog.", " capital.", " CUDA"], 0)]
MC_TASK = """task: pyserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: pyserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess("--served-model-name", "tiny", command=("serve", str(model_dir)))
    yield srv
    assert srv.stop() == 0


def test_loglikelihoods_match_transformers_and_chat_generates(server, model_dir, offline, tmp_path):
    env, _ = offline
    env = {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    items = tmp_path / "mc.jsonl"
    items.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                             for q, c, a in ITEMS))
    gen = tmp_path / "gen.jsonl"
    gen.write_text(json.dumps({"question": "Paris is the capital of", "answer": " France."}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "pyserve_mc.yaml").write_text(MC_TASK.format(data=items))
    (tasks / "pyserve_gen.yaml").write_text(GEN_TASK.format(data=gen))
    python = python_client("lm-eval") / "python"
    done = subprocess.run([str(python), str(Path(__file__).with_name("run_lm_eval.py")), server.url,
                           str(model_dir), str(tasks)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    served, reference = got["served"], got["reference"]
    assert len(served["resps"]) == len(ITEMS)
    for item, ours, theirs in zip(ITEMS, served["resps"], reference["resps"]):
        for (ll, greedy), (ll_ref, greedy_ref) in zip(ours, theirs):
            assert abs(ll - ll_ref) <= TOLERANCE, (item, ours, theirs)
            assert greedy == greedy_ref, (item, ours, theirs)
    assert served["acc"] == reference["acc"]
    [[text]] = got["generated"]["resps"]
    assert isinstance(text, str)
