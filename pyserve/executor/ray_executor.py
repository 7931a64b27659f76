"""The Ray executor (--distributed-executor-backend ray): rank 0 runs in this process, as in the
multiprocess executor; ranks 1..N-1 are Ray actors (ray_worker.py), so they may sit on other
machines of a Ray cluster.

Start-up: join the cluster this node belongs to (RAY_ADDRESS, or one `ray start` began here),
or start a local one; reserve placement groups with one bundle per rank (ray_placement.py:
one group, or one per pipeline stage when the world does not fit this node); start one actor
per bundle; pick each communicator's kind from its ranks' nodes (ray_collectives.py: shared
memory on one node, gloo across nodes); then every rank joins the communicators, loads its
shard (under pipeline parallelism, its stage's layers), and meets at a barrier. Ray carries
only start-up and control: each step's inputs go to the other ranks over the world
communicator (step_channel.py's layout, broadcast by rank 0), activations stage to stage over
the hops (pipeline_stage.py).

Faults: each actor runs one long serve() call; a watchdog thread waits on those object refs
with ray.wait, which returns the moment an actor dies (RayActorError) or its serve() fails.
Then rank 0's communicators are aborted and every actor killed, so a collective in flight on rank 0
raises at once instead of hanging (a dead peer's sockets close), and the failure callback
tells the engine. Shutdown (also on garbage collection and at exit) kills every actor, waits
for Ray to report them dead, and removes the placement groups; if this executor started or
joined Ray, it disconnects (a local cluster it started ends with it). Should this process die
outright, Ray ends its actors and placement groups with its job."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import weakref
from collections.abc import Callable

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pyserve.config import ParallelConfig
from pyserve.errors import ModelLoadError
from pyserve.executor.base import Executor
from pyserve.executor.gloo_communicator import GlooRendezvous, host_store
from pyserve.executor.multiproc import slot_bytes
from pyserve.executor.pipeline import PipelineLayout
from pyserve.executor.ray_collectives import (Collectives, choose_collectives, connect, connect_links,
                                              segment_kinds)
from pyserve.executor.ray_placement import GroupPlacement, world_placement
from pyserve.executor.ray_worker import RankInfo, RankStart, RayWorker
from pyserve.executor.shard import ShardSpec, build_model_runner, build_stage_runner
from pyserve.executor.step_channel import StepChannel
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.runner import ForwardInputs

logger = logging.getLogger("pyserve")

PLACEMENT_TIMEOUT_S = 60.0  # the cluster has the CPUs, or it is told why not
ACTOR_START_TIMEOUT_S = 120.0  # a fresh Ray worker process imports torch and pyserve
STOP_TIMEOUT_S = 5.0


class RayExecutor(Executor):
    description = "ray"

    def __init__(self, spec: ShardSpec, parallel: ParallelConfig):
        if spec.device == "cuda":
            # The CUDA seam: rank 0 would make _native.nccl_unique_id() and hand it to the actors
            # in ray_collectives.Collectives; bundles would ask for {"GPU": 1}; each actor would
            # build _native.NcclCommunicator for the model, the step channel staying on shm/gloo.
            raise ModelLoadError("--distributed-executor-backend ray runs on the CPU only for now; "
                                 "use mp for tensor parallelism on CUDA")
        self._group = RayRankGroup(spec, parallel)
        self._finalizer = weakref.finalize(self, self._group.stop)
        try:
            self.runner = self._group.join_as_rank_zero()
        except Exception as exc:
            self.shutdown()
            raise ModelLoadError(f"{self._group.kind}-parallel start-up failed: "
                                 f"{self._group.failure or exc}") from exc
        self.channel = StepChannel(self._group.comm)
        logger.info("%s", self._group.describe())

    @property
    def failure(self) -> str | None:
        return self._group.failure

    @property
    def rank_pids(self) -> list[int]:
        return [os.getpid(), *(info.pid for info in self._group.infos)]

    @property
    def rank_nodes(self) -> list[str]:
        """Each rank's Ray node id, in rank order."""
        return self._group.node_ids

    @property
    def collectives(self) -> str:
        """The world communicator's kind."""
        return self._group.plan.kind

    @property
    def segment_kinds(self) -> dict[str, str]:
        """Pipeline parallelism: each stage group's, hop's and the logits' communicator kind,
        by role ("tp0", "hop0.0", "logits")."""
        plan = self._group.plan
        if plan.pipeline is None:
            return {}
        base = plan.pipeline.base_name
        return {name[len(base) + 1:]: kind for name, kind in plan.segments}

    def _broadcast(self, inputs: ForwardInputs) -> None:
        self.channel.send(inputs)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """callback(reason) runs on the watchdog thread when an actor dies outside shutdown."""
        self._group.callbacks.append(callback)
        if self._group.failure is not None:
            callback(self._group.failure)

    def shutdown(self) -> None:
        self._finalizer()  # runs once


class RayRankGroup:
    """The placement groups, the actors (ranks 1..N-1) and rank 0's communicators, and their
    watchdog. Holds no reference to the executor, so that the executor's finalizer can stop it."""

    def __init__(self, spec: ShardSpec, parallel: ParallelConfig):
        self.spec, self.size = spec, spec.world_size
        self.failure: str | None = None
        self.callbacks: list[Callable[[str], None]] = []
        self.stopping = threading.Event()
        self.comm = None  # the world communicator
        self.comms: list = []  # every communicator rank 0 holds: aborted on failure and stop
        self.actors: list = []
        self.serving: dict = {}  # serve()'s object ref -> rank
        self.infos: list[RankInfo] = []
        self.pgs: list = []
        self.plan: Collectives | None = None
        self._store = None  # gloo: rank 0's rendezvous store
        self.owns_ray = _join_cluster()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.placements = world_placement(spec.tensor_parallel_size, spec.pipeline_parallel_size,
                                          self.node_id, _node_cpus(self.node_id),
                                          _largest_node_cpus(), parallel.ray_cpus_per_rank)
        self.cpus_per_rank = self.placements[0].cpus_per_rank
        try:
            for placement in self.placements:
                self.pgs.append(_reserve(placement, self.size))
            self._start_actors()
            self.node_ids = self._rank_nodes()
            self._plan_collectives(parallel.ray_collectives)
        except BaseException:
            self.stop()
            raise
        ranks = {rank: actor for rank, actor in enumerate(self.actors, 1)}
        self.serving = {actor.serve.remote(RankStart(spec, rank, self.cpus_per_rank, self.plan)): rank
                        for rank, actor in ranks.items()}
        self._watchdog = threading.Thread(target=self._watch, name="pyserve-ray-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def kind(self) -> str:
        """"pipeline" or "tensor": what the logs and errors call the world."""
        return "pipeline" if self.spec.pipeline_parallel_size > 1 else "tensor"

    def _bundle(self, rank: int) -> tuple[object, int]:
        """-> (rank's placement group, its bundle index there)."""
        for pg, placement in zip(self.pgs, self.placements):
            if rank in placement.ranks:
                return pg, rank - placement.first_rank
        raise ValueError(rank)

    def _rank_nodes(self) -> list[str]:
        """Each rank's Ray node id: rank 0 is this process; the others' nodes are their bundles'."""
        tables = {pg.id: placement_group_table(pg)["bundles_to_node_id"] for pg in self.pgs}
        nodes = [self.node_id]
        for rank in range(1, self.size):
            pg, index = self._bundle(rank)
            nodes.append(tables[pg.id][index])
        return nodes

    def _start_actors(self) -> None:
        worker = ray.remote(RayWorker)
        tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        for rank in range(1, self.size):
            pg, index = self._bundle(rank)
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
            # named, so that `ray list actors` (and tests) can tell ours apart
            self.actors.append(worker.options(name=f"pyserve-rank{rank}-{tag}",
                                              num_cpus=self.cpus_per_rank,
                                              scheduling_strategy=strategy).remote())
        try:
            self.infos = ray.get([a.describe.remote() for a in self.actors],
                                 timeout=ACTOR_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ModelLoadError(f"the Ray actors for ranks 1..{self.size - 1} did not start within "
                                 f"{ACTOR_START_TIMEOUT_S:.0f}s; see the Ray logs") from None
        except ray.exceptions.RayError as exc:  # e.g. pyserve not importable on that node
            raise ModelLoadError(f"a Ray actor for ranks 1..{self.size - 1} failed to start: "
                                 f"{_first_line(exc)}; every node needs pyserve's environment "
                                 "(docs/multi-node.md)") from exc

    def _plan_collectives(self, requested: str) -> None:
        spec, slot = self.spec, slot_bytes(self.spec)
        name = f"/pyserve-tp-{os.getpid()}-{secrets.token_hex(6)}"
        kind = choose_collectives(self.node_ids, requested)
        layout, segments = None, ()
        if spec.pipeline_parallel_size > 1:
            layout = PipelineLayout(spec.tensor_parallel_size, spec.pipeline_parallel_size, name, slot)
            segments = tuple(segment_kinds(layout, self.node_ids, requested).items())
        rendezvous = None
        if "gloo" in (kind, *dict(segments).values()):  # every gloo group meets in one store
            self._store = host_store(self.node_ip, self.size)
            rendezvous = GlooRendezvous(self.node_ip, self._store.port)
        self.plan = Collectives(kind, self.size, name if kind == "shm" else "", slot, rendezvous,
                                layout, segments)
        if kind == "shm":
            self.comm = connect(self.plan, 0, self.node_ip)  # created before the actors attach
            self.comms.append(self.comm)

    def join_as_rank_zero(self):
        """Rank 0 joins the communicators, loads its shard and waits for every rank's."""
        torch.set_num_threads(self.cpus_per_rank)
        spec = self.spec
        if self.plan.kind == "gloo":
            self.comm = connect(self.plan, 0, self.node_ip, self._store)
            self.comms.append(self.comm)
        else:
            self.comm.barrier()  # every rank attached
            self.comm.unlink()
        if self.plan.pipeline is None:
            runner = build_model_runner(spec, TPGroup(0, self.size, self.comm))
        else:
            links = connect_links(self.plan, 0, self.node_ip, self.comm, self._store, self.comms)
            runner = build_stage_runner(spec, links)
        self.comm.barrier()  # every rank loaded
        return runner

    def describe(self) -> str:
        ranks = [f"rank 0: node {self.node_ip} ({self.node_id[:16]}), {self.spec.device}, "
                 f"pid {os.getpid()}"]
        ranks += [f"rank {rank}: node {info.node_ip} ({info.node_id[:16]}), {self.spec.device}, "
                  f"pid {info.pid}" for rank, info in enumerate(self.infos, 1)]
        strategies = "/".join(p.strategy for p in self.placements)
        groups = f"{len(self.placements)} placement groups" if len(self.placements) > 1 else "placement"
        if self.plan.pipeline is None:
            what = f"tensor parallel over Ray: {self.size} ranks, {self.plan.kind} collectives"
        else:
            kinds = sorted({kind for _, kind in self.plan.segments} | {self.plan.kind})
            what = (f"pipeline parallel over Ray: {self.spec.pipeline_parallel_size} stages of "
                    f"{self.spec.tensor_parallel_size} rank(s), {self.size} ranks, "
                    f"{'+'.join(kinds)} collectives (world {self.plan.kind})")
        return (f"{what}, {strategies} {groups}, {self.cpus_per_rank} CPU(s) each; "
                + "; ".join(ranks))

    def _watch(self) -> None:
        ready, _ = ray.wait(list(self.serving), num_returns=1, timeout=None)
        if self.stopping.is_set():
            return
        rank = self.serving[ready[0]]
        info = self.infos[rank - 1]
        where = f"{self.kind}-parallel rank {rank} (Ray actor pid {info.pid} on node {info.node_ip})"
        try:
            ray.get(ready[0])
            reason = f"{where} stopped serving"
        except ray.exceptions.RayActorError as exc:
            reason = f"{where} died: {_first_line(exc)}"
        except ray.exceptions.RayError as exc:
            reason = f"{where} failed: {_first_line(exc)}"
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        self.failure = reason
        logger.error("%s; the engine cannot continue", reason)
        for comm in self.comms:
            comm.abort()
        for actor in self.actors:  # closes their sockets: a gloo collective on rank 0 raises
            ray.kill(actor, no_restart=True)
        for callback in self.callbacks:
            callback(reason)

    def stop(self) -> None:
        """Kills every actor and removes the placement group; idempotent."""
        already = self.stopping.is_set()
        self.stopping.set()
        for comm in self.comms:
            comm.abort()  # shm: ends the actors' wait for the next step
        if self.comm is not None and self.plan.kind == "shm":
            self.comm.unlink()
        self._store = None  # rank 0's gloo store stops listening once its groups are gone
        if already or not ray.is_initialized():  # Ray already gone: so are our actors
            return
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.serving:  # each ref resolves once Ray has its actor dead
            ray.wait(list(self.serving), num_returns=len(self.serving), timeout=STOP_TIMEOUT_S)
            self._watchdog.join(STOP_TIMEOUT_S)
        for pg in self.pgs:
            remove_placement_group(pg)
        logger.info("%s parallel over Ray: stopped %d actor(s), removed the placement group%s",
                    self.kind, len(self.actors), "s" if len(self.pgs) > 1 else "")
        if self.owns_ray:
            ray.shutdown()


def _join_cluster() -> bool:
    """Connects to Ray; True when this call did (so that stop() disconnects)."""
    if ray.is_initialized():  # the caller's own connection: theirs to end
        return False
    try:
        ray.init(address="auto")  # RAY_ADDRESS, or the cluster `ray start` began on this node
    except ConnectionError:
        logger.info("no Ray cluster to join (RAY_ADDRESS unset, no `ray start` on this node): "
                    "starting a local one")
        ray.init(include_dashboard=False)
    return True


def _node_cpus(node_id: str) -> int:
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return int(node["Resources"].get("CPU", 0))
    return 0


def _largest_node_cpus() -> int:
    return max((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]), default=0)


def _reserve(placement: GroupPlacement, world_size: int):
    pg = placement_group(list(placement.bundles), strategy=placement.strategy,
                         bundle_label_selector=list(placement.label_selectors))
    if pg.wait(PLACEMENT_TIMEOUT_S):
        return pg
    remove_placement_group(pg)  # a pending group would take the CPUs once they are free
    cpus = sorted((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]), reverse=True)
    size = len(placement.bundles)
    ranks = (f"{size} ranks" if size == world_size
             else f"ranks {placement.first_rank}..{placement.first_rank + size - 1} (one stage)")
    node = "this node" if placement.first_rank == 0 else "one node"
    where = f"on {node}" if placement.fits_one_node else f"on {node} and others"
    raise ModelLoadError(f"the Ray cluster cannot place {ranks} of {placement.cpus_per_rank} "
                         f"CPU(s) each {where} within {PLACEMENT_TIMEOUT_S:.0f}s (its nodes' CPUs: "
                         f"{cpus}; rank 0 needs its bundle on this node); add nodes, or lower "
                         "--ray-cpus-per-rank")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
