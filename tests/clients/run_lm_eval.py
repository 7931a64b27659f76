"""Run inside lm-evaluation-harness's own environment (installs.py) by test_lm_eval.py: a small
local multiple-choice task scored through `local-completions` (pyserve's echo + logprobs) and
through `--model hf` (transformers on the same weights), and one generate_until item through
`local-chat-completions`. Prints one JSON object: per-item loglikelihoods and accuracy of each
model, and the generated text. argv: the server's URL, the model folder, the task folder."""

import json
import sys

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

url, model_dir, tasks_dir = sys.argv[1:4]
tasks = TaskManager(include_path=tasks_dir)


def run(model: str, model_args: str, task: str, **kw) -> dict:
    out = simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks,
                          log_samples=True, batch_size=1, random_seed=0, numpy_random_seed=0,
                          torch_random_seed=0, fewshot_random_seed=0, **kw)
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return {"acc": out["results"][task].get("acc,none"),
            "resps": [[r[0] for r in s["resps"]] for s in samples]}


served = run("local-completions", f"model=tiny,base_url={url}/v1/completions,tokenizer={model_dir},"
             "tokenized_requests=True,num_concurrent=1,max_retries=1", "pyserve_mc")
reference = run("hf", f"pretrained={model_dir},dtype=float32,device=cpu", "pyserve_mc")
generated = run("local-chat-completions", f"model=tiny,base_url={url}/v1/chat/completions,"
                "num_concurrent=1,max_retries=1", "pyserve_gen", apply_chat_template=True)
print(json.dumps({"served": served, "reference": reference, "generated": generated}))
