"""The Ray executor on a real two-node Ray cluster on this machine (a head and a second raylet,
ray.cluster_utils.Cluster, one for the module): rank 1 in the other node's raylet reducing
through gloo, or beside rank 0 through shared memory; pipeline stages in either node, TP=2 x
PP=2 with a stage per node; the oracle is the same engine at size 1. Also through a real
server at TP=2 and at PP=2: the same text, a killed actor ends it, SIGTERM leaves nothing
registered in the cluster. The placement and gloo pieces are checked without Ray first.

About 150 s on 2 cores, most of it the cluster's and the actors' start-up."""

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
from pyserve.executor.ray_placement import NODE_ID_LABEL, world_placement
from pyserve.executor.step_channel import StepChannel
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.runner import ForwardInputs

from ..e2e.server import ServerProcess, cmdline, kill_rank_mid_stream
from .ranks import assert_same_greedy, assert_same_step

PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 200, 300], list(range(3, 60)), [7] * 20]
TEXT_PROMPTS = ["The quick brown fox", "Paris is the capital of"]
NODE_CPUS = 2  # each node's; --ray-cpus-per-rank 2 puts the two ranks on different nodes
ACROSS_NODES = dict(tensor_parallel_size=2, ray_cpus_per_rank=NODE_CPUS, ray_collectives="gloo")


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


def test_placement_packs_a_world_that_fits_the_driver_node_and_spreads_one_that_does_not():
    (one,) = world_placement(2, 1, "n0", driver_node_cpus=8, largest_node_cpus=8)
    assert (one.strategy, one.cpus_per_rank) == ("STRICT_PACK", 4)
    assert one.bundles == ({"CPU": 4.0}, {"CPU": 4.0})
    assert one.label_selectors == ({NODE_ID_LABEL: "n0"}, {})  # bundle 0 is rank 0, here
    (wide,) = world_placement(2, 1, "n0", driver_node_cpus=8, largest_node_cpus=8, cpus_per_rank=8)
    assert (wide.strategy, wide.bundles) == ("PACK", ({"CPU": 8.0}, {"CPU": 8.0}))
    assert world_placement(4, 1, "n0", driver_node_cpus=2, largest_node_cpus=2)[0].cpus_per_rank == 1
    # PP: a world that fits is one group; one that does not, a group per stage, each on one node
    (fits,) = world_placement(2, 2, "n0", driver_node_cpus=8, largest_node_cpus=8)
    assert (fits.strategy, len(fits.bundles), fits.cpus_per_rank) == ("STRICT_PACK", 4, 2)
    stages = world_placement(2, 3, "n0", driver_node_cpus=4, largest_node_cpus=4, cpus_per_rank=2)
    assert [(g.strategy, list(g.ranks)) for g in stages] == [
        ("STRICT_PACK", [0, 1]), ("STRICT_PACK", [2, 3]), ("STRICT_PACK", [4, 5])]
    assert [g.label_selectors for g in stages] == [({NODE_ID_LABEL: "n0"}, {}), ({}, {}), ({}, {})]
    too_wide = world_placement(2, 2, "n0", driver_node_cpus=4, largest_node_cpus=4, cpus_per_rank=4)
    assert [g.strategy for g in too_wide] == ["PACK", "PACK"]  # a stage wider than any node
    # stage 0 is pinned to the driver: packed only if it fits there, whatever the largest node
    small_driver = world_placement(2, 2, "n0", driver_node_cpus=4, largest_node_cpus=16, cpus_per_rank=4)
    assert [g.strategy for g in small_driver] == ["PACK", "STRICT_PACK"]
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


def assert_over_ray_equals_tp1(model: str, check, **flags) -> None:
    """The model over Ray with flags gives TP=1's greedy ids and logprobs; check(executor) runs
    while it serves. Afterwards nothing is left registered in the cluster or in /dev/shm."""
    want = reference(model, logprobs=3)
    llm = LLM(model, kv_cache_memory=1 << 22, distributed_executor_backend="ray", **flags)
    try:
        check(llm.engine.executor)
        got = greedy(llm, logprobs=3)
    finally:
        llm.shutdown()
    assert_same_greedy(want, got)
    wait_until_nothing_registered()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"pyserve-tp-{os.getpid()}-")]


def on_this_node(executor) -> bool:
    return executor.rank_nodes[0] == ray.get_runtime_context().get_node_id()


# llama: 2 KV heads, one per rank; qwen2: 1 KV head replicated on both ranks, qkv bias
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_across_two_ray_nodes_over_gloo_equals_tp1(cluster, tiny_model_factory, arch):
    def check(executor):
        assert executor.collectives == "gloo"
        assert len(set(executor.rank_nodes)) == 2 and on_this_node(executor)  # rank 1 elsewhere
        assert len(ours_registered()[0]) == 1

    assert_over_ray_equals_tp1(str(tiny_model_factory(arch)), check, **ACROSS_NODES)


def test_tp2_on_one_ray_node_uses_shared_memory(cluster, tiny_model_factory):
    def check(executor):
        assert executor.collectives == "shm" and len(set(executor.rank_nodes)) == 1

    assert_over_ray_equals_tp1(str(tiny_model_factory("llama")), check, tensor_parallel_size=2)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_pp2_across_two_ray_nodes_equals_tp1(cluster, tiny_model_factory, arch):
    """Each rank takes a whole node, so stage 1 runs in the other raylet; two micro-batches."""
    def check(executor):
        nodes = executor.rank_nodes
        assert on_this_node(executor) and nodes[1] != nodes[0]
        assert len(executor._group.pgs) == 2  # one placement group per stage
        assert (executor.collectives, executor.segment_kinds) == (
            "gloo", {"hop0.0": "gloo", "logits": "gloo"})

    assert_over_ray_equals_tp1(str(tiny_model_factory(arch)), check, pipeline_parallel_size=2,
                               pipeline_micro_batches=2, ray_cpus_per_rank=NODE_CPUS)


def test_tp2_x_pp2_over_ray_keeps_each_stage_on_one_node(cluster, tiny_model_factory):
    """Four ranks of one CPU: stage 0's two on this node, stage 1's on the other; each stage
    reduces through its node's shared memory (stage 1's segment created by an actor), the
    hops between them go over gloo."""
    def check(executor):
        nodes = executor.rank_nodes
        assert on_this_node(executor) and nodes[0] == nodes[1] != nodes[2] == nodes[3]
        assert executor.segment_kinds == {"tp0": "shm", "tp1": "shm", "hop0.0": "gloo",
                                          "hop0.1": "gloo", "logits": "gloo"}
        assert len(ours_registered()[0]) == 3

    assert_over_ray_equals_tp1(str(tiny_model_factory("llama")), check, tensor_parallel_size=2,
                               pipeline_parallel_size=2, ray_cpus_per_rank=1)


def test_pp2_on_one_ray_node_is_all_shared_memory(cluster, tiny_model_factory):
    def check(executor):
        assert len(set(executor.rank_nodes)) == 1
        assert (executor.collectives, executor.segment_kinds) == (
            "shm", {"hop0.0": "shm", "logits": "shm"})

    assert_over_ray_equals_tp1(str(tiny_model_factory("llama")), check, pipeline_parallel_size=2)


def ray_rank_pids() -> list[int]:
    """This machine's processes running a rank's serve() (Ray names them so)."""
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and cmdline(int(p)).startswith("ray::RayWorker")]


# each run: two ranks, one per node, gloo between them
SERVER_LAYOUTS = {"tp2": ["--tensor-parallel-size", "2"], "pp2": ["--pipeline-parallel-size", "2"]}


def ray_server(cluster, model: str, layout: str = "tp2") -> ServerProcess:
    flags = [*SERVER_LAYOUTS[layout], "--distributed-executor-backend", "ray",
             "--ray-cpus-per-rank", str(NODE_CPUS), "--ray-collectives", "gloo"]
    return ServerProcess("--model", model, *flags, env={"RAY_ADDRESS": cluster.address})


@pytest.mark.parametrize("layout", SERVER_LAYOUTS)
def test_server_over_ray_matches_offline_tp1_and_sigterm_leaves_nothing(cluster, tiny_model_factory,
                                                                        layout):
    model = str(tiny_model_factory("llama"))
    llm = LLM(model, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(TEXT_PROMPTS, params)]
    llm.shutdown()
    server = ray_server(cluster, model, layout)
    try:
        assert len(ours_registered()[0]) == 1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model=model, prompt=TEXT_PROMPTS, max_tokens=16,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    finally:
        code = server.stop()
    assert code == 0
    output = server.output()
    if layout == "tp2":
        assert "tensor parallel over Ray: 2 ranks, gloo collectives" in output
        assert "stopped 1 actor(s), removed the placement group" in output  # by the server, not Ray
    else:
        assert "pipeline parallel over Ray: 2 stages of 1 rank(s), 2 ranks, gloo collectives" in output
        assert "stopped 1 actor(s), removed the placement groups" in output
    wait_until_nothing_registered()
    assert ray_rank_pids() == []


@pytest.mark.parametrize("layout", SERVER_LAYOUTS)
def test_killed_actor_turns_health_503_fails_the_stream_and_ends_the_server(cluster, tiny_model_factory,
                                                                          layout):
    model = str(tiny_model_factory("llama"))
    server = ray_server(cluster, model, layout)
    try:
        (actor,) = ray_rank_pids()
        kill_rank_mid_stream(server, actor, model, "The quick brown fox", 10, 20)
    finally:
        server.stop()
    output = server.output()
    kind = "tensor" if layout == "tp2" else "pipeline"
    assert f"{kind}-parallel rank 1" in output and "died" in output and "the engine died" in output
    wait_until_nothing_registered()
