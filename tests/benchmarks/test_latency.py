"""benchmarks/latency.py: one small batch through the offline engine on the tiny model."""

import json

from benchmarks.latency import main, run_batch


def test_latency_reports_batch_and_step_latencies(tiny_dir, tmp_path, capsys):
    out_json = tmp_path / "latency.json"
    assert main(["--model", str(tiny_dir), "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "2",
                 "--output-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "Avg latency:" in out and "99% percentile latency:" in out
    assert "Avg per-step latency (one token for each of 2 requests):" in out
    r = json.loads(out_json.read_text())
    assert r["model_id"] == str(tiny_dir) and len(r["latencies"]) == 2
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert 0 < r["avg_first_token_latency"] < r["avg_latency"]
    assert r["avg_step_latency_ms"] > 0


def test_python_layers_switches_the_native_stack_off(tiny_dir, capsys):
    """--python-layers runs every decoder layer through its Python modules: the tiny Llama's
    layers all had native specs, and the run reports how many it turned off."""
    assert main(["--model", str(tiny_dir), "--batch-size", "1", "--input-len", "8",
                 "--output-len", "3", "--num-iters-warmup", "0", "--num-iters", "1",
                 "--python-layers"]) == 0
    out = capsys.readouterr().out
    assert "2 decoder layers in Python" in out and "Avg per-step latency" in out


class FakeCore:
    """Prefill in the first step, then one token per request per step."""

    def __init__(self, output_len):
        self.left, self.output_len = {}, output_len

    def add_request(self, request_id, prompt, params):
        self.left[request_id] = self.output_len

    def has_unfinished(self):
        return any(self.left.values())

    def step(self):
        from types import SimpleNamespace

        outs = []
        for rid in self.left:
            if self.left[rid]:
                self.left[rid] -= 1
                outs.append(SimpleNamespace(request_id=rid,
                                            outputs=[SimpleNamespace(token_ids=[7])]))
        return outs


def test_steps_after_every_first_token_are_decode_steps():
    import itertools

    latency, first_token, steps = run_batch(FakeCore(5), [[1], [2], [3]], None, itertools.count())
    assert len(steps) == 4 and 0 < first_token <= latency
