"""The Ray executor on a real two-node Ray cluster on this machine (a head and a second raylet,
ray.cluster_utils.Cluster, one for the module): rank 1 in the other node's raylet reducing
through gloo, or beside rank 0 through shared memory; the oracle is the same engine at size 1.
Also through a real server: the same text, a killed actor ends it, SIGTERM leaves nothing
registered in the cluster. The placement and gloo pieces are checked without Ray first.

About 80 s on 2 busy cores (load average 6), most of it the cluster's and the actors' start-up."""

import os
import subprocess
import sys
import threading
import time

import openai
import pytest
import ray  # pinned in requirements.txt: a missing install fails here, never skips
import torch

from pyserve import LLM, SamplingParams
from pyserve.cli import parse_config
from pyserve.executor.gloo_communicator import GlooCommunicator, GlooRendezvous, host_store
from pyserve.executor.ray_collectives import choose_collectives
from pyserve.executor.ray_placement import NODE_ID_LABEL, group_placement
from pyserve.executor.step_channel import StepChannel
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.runner import ForwardInputs

from ..e2e.server import ServerProcess, cmdline, kill_rank_mid_stream
from .ranks import assert_same_greedy, assert_same_step

PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 200, 300], list(range(3, 60)), [7] * 20]
TEXT_PROMPTS = ["The quick brown fox", "Paris is the capital of"]
NODE_CPUS = 2  # each node's; --ray-cpus-per-rank 2 puts the two ranks on different nodes
ACROSS_NODES = dict(tensor_parallel_size=2, distributed_executor_backend="ray",
                    ray_cpus_per_rank=NODE_CPUS, ray_collectives="gloo")


def test_ray_is_not_imported_unless_its_backend_is_chosen():
    code = ("import sys; import pyserve.cli, pyserve.server.app, pyserve.engine.core; "
            "from pyserve.config import ParallelConfig; from pyserve.executor import executor_class; "
            "executor_class(ParallelConfig(2)); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ray_flags_reach_the_parallel_config():
    parallel = parse_config(["--distributed-executor-backend", "ray", "-tp", "2",
                             "--ray-cpus-per-rank", "3"], environ={"PYSERVE_RAY_COLLECTIVES": "gloo"}).parallel
    assert (parallel.distributed_executor_backend, parallel.ray_collectives,
            parallel.ray_cpus_per_rank) == ("ray", "gloo", 3)
    assert parse_config([], environ={}).parallel.ray_collectives == "auto"
    with pytest.raises(SystemExit):
        parse_config(["--ray-collectives", "nccl"], environ={})


def test_placement_packs_a_group_that_fits_the_driver_node_and_spreads_one_that_does_not():
    one = group_placement(2, "n0", driver_node_cpus=8)
    assert (one.strategy, one.cpus_per_rank) == ("STRICT_PACK", 4)
    assert one.bundles == ({"CPU": 4.0}, {"CPU": 4.0})
    assert one.label_selectors == ({NODE_ID_LABEL: "n0"}, {})  # bundle 0 is rank 0, here
    wide = group_placement(2, "n0", driver_node_cpus=8, cpus_per_rank=8)
    assert (wide.strategy, wide.bundles) == ("PACK", ({"CPU": 8.0}, {"CPU": 8.0}))
    assert group_placement(4, "n0", driver_node_cpus=2).cpus_per_rank == 1
    assert choose_collectives(["a", "a"], "auto") == "shm"
    assert choose_collectives(["a", "b"], "auto") == "gloo"
    assert choose_collectives(["a", "a"], "gloo") == "gloo"


def test_gloo_communicator_collectives_and_step_channel_round_trip():
    store = host_store("127.0.0.1", 2)
    rendezvous = GlooRendezvous("127.0.0.1", store.port)
    comms = [None, None]

    def join(rank):
        comms[rank] = GlooCommunicator(rendezvous, rank, 2, "127.0.0.1", store if rank == 0 else None)

    joiners = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in joiners:
        t.start()
    for t in joiners:
        t.join(30)
    sent = ForwardInputs(torch.arange(300), torch.arange(300) + 7,
                         AttentionMetadata(torch.arange(300) * 3,
                                           torch.arange(12, dtype=torch.int32).view(3, 4),
                                           torch.tensor([0, 100, 200, 300], dtype=torch.int32),
                                           torch.tensor([100, 150, 120], dtype=torch.int32)),
                         torch.tensor([99, 199, 299]))
    results = {}

    def rank1():
        comm = comms[1]
        results["step"] = StepChannel(comm).receive()
        x = torch.full((3,), 2.0)
        comm.all_reduce(x)
        results["reduced1"] = x
        results["gathered1"] = comm.gather(torch.tensor([1.0, 1.5]), 0)
        results["all1"] = comm.all_gather(torch.tensor([7]))
        comm.barrier()

    t = threading.Thread(target=rank1)
    t.start()
    comm = comms[0]
    StepChannel(comm).send(sent)
    x = torch.arange(3, dtype=torch.float32)
    comm.all_reduce(x)
    gathered = comm.gather(torch.tensor([0.0, 0.5]), 0)
    every = comm.all_gather(torch.tensor([3]))
    comm.barrier()
    t.join(30)
    got = results["step"]
    assert_same_step(sent, got)
    assert x.tolist() == [2.0, 3.0, 4.0] and results["reduced1"].tolist() == [2.0, 3.0, 4.0]
    assert gathered.tolist() == [[0.0, 0.5], [1.0, 1.5]]
    assert every.tolist() == [[3], [7]] and results["all1"].tolist() == [[3], [7]]
    comm.abort()
    with pytest.raises(RuntimeError, match="aborted"):
        comm.all_reduce(x)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS})
    cluster.add_node(num_cpus=NODE_CPUS)
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def ours_registered() -> tuple[list[str], list[str]]:
    """The pyserve actors alive in the cluster, and its placement groups not removed."""
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("pyserve-rank")]
    groups = [g["placement_group_id"] for g in ray.util.placement_group_table().values()
              if g["state"] != "REMOVED"]
    return actors, groups


def wait_until_nothing_registered(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while ours_registered() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours_registered() == ([], [])


def greedy(llm, max_tokens=16, **extra):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)


def reference(model: str, **extra):
    llm = LLM(model, kv_cache_memory=1 << 22)
    try:
        return greedy(llm, **extra)
    finally:
        llm.shutdown()


# llama: 2 KV heads, one per rank; qwen2: 1 KV head replicated on both ranks, qkv bias
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_across_two_ray_nodes_over_gloo_equals_tp1(cluster, tiny_model_factory, arch):
    model = str(tiny_model_factory(arch))
    want = reference(model, logprobs=3)
    llm = LLM(model, kv_cache_memory=1 << 22, **ACROSS_NODES)
    try:
        executor = llm.engine.executor
        assert executor.collectives == "gloo"
        nodes = executor.rank_nodes
        assert len(set(nodes)) == 2  # rank 1 really runs in the other raylet
        assert nodes[0] == ray.get_runtime_context().get_node_id()
        assert len(ours_registered()[0]) == 1
        got = greedy(llm, logprobs=3)
    finally:
        llm.shutdown()
    assert_same_greedy(want, got)
    wait_until_nothing_registered()


def test_tp2_on_one_ray_node_uses_shared_memory(cluster, tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    want = [o.outputs[0].token_ids for o in reference(model)]
    llm = LLM(model, kv_cache_memory=1 << 22, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        executor = llm.engine.executor
        assert executor.collectives == "shm"
        assert len(set(executor.rank_nodes)) == 1
        got = [o.outputs[0].token_ids for o in greedy(llm)]
    finally:
        llm.shutdown()
    assert got == want
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"pyserve-tp-{os.getpid()}-")]
    wait_until_nothing_registered()


def ray_rank_pids() -> list[int]:
    """This machine's processes running a rank's serve() (Ray names them so)."""
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and cmdline(int(p)).startswith("ray::RayWorker")]


def ray_server(cluster, model: str) -> ServerProcess:
    flags = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
             "--ray-cpus-per-rank", str(NODE_CPUS), "--ray-collectives", "gloo"]
    return ServerProcess("--model", model, *flags, env={"RAY_ADDRESS": cluster.address})


def test_server_over_ray_matches_offline_tp1_and_sigterm_leaves_nothing(cluster, tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    llm = LLM(model, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(TEXT_PROMPTS, params)]
    llm.shutdown()
    server = ray_server(cluster, model)
    try:
        assert len(ours_registered()[0]) == 1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model=model, prompt=TEXT_PROMPTS, max_tokens=16,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    finally:
        code = server.stop()
    assert code == 0
    output = server.proc.stdout.read()
    assert "tensor parallel over Ray: 2 ranks, gloo collectives" in output
    assert "stopped 1 actor(s), removed the placement group" in output  # by the server, not Ray
    wait_until_nothing_registered()
    assert ray_rank_pids() == []


def test_killed_actor_turns_health_503_fails_the_stream_and_ends_the_server(cluster, tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    server = ray_server(cluster, model)
    try:
        (actor,) = ray_rank_pids()
        kill_rank_mid_stream(server, actor, model, "The quick brown fox", 10, 20)
    finally:
        server.stop()
    output = server.proc.stdout.read()
    assert "tensor-parallel rank 1" in output and "died" in output and "the engine died" in output
    wait_until_nothing_registered()
