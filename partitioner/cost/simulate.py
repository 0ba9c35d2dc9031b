"""Event simulator of per-rank programs with communication ops (COST_MODEL.md, "What the model
must be able to say").

Input: one ``ir.Model`` per rank (rank i runs on ``cluster.devices[i]``), holding ordinary
compute nodes and nodes in the ``partitioner.comm`` domain (opset 1):

- ``Send(x)`` attrs peer, tag — non-blocking: the sender goes on after posting it
  (:func:`~partitioner.cost.comm.send_overhead`, counted as its comm); the message arrives at
  send start + :func:`~partitioner.cost.comm.p2p_time`.
- ``Recv() -> y`` attrs peer, tag, shape, dtype — blocks until the matching message has arrived;
  one that arrived earlier still costs the receiver :func:`~partitioner.cost.comm.send_overhead`.
  Send/Recv match on (src, dst, tag), first-in first-out.
- ``AllReduce``, ``AllGather``, ``ReduceScatter``, ``AllToAll``, ``Broadcast`` attrs group (global
  ranks), tag, ... — start when every member has reached it (the k-th occurrence of
  (kind, group, tag) on each member matches) and take
  :func:`~partitioner.cost.comm.collective_time`, with ``n`` as defined there.

Each rank runs its program ``microbatches`` times in a row. Compute nodes take their roofline
time (:func:`~partitioner.cost.roofline.op_time`) on the rank's device; consecutive compute nodes
are merged into one segment, and per-node costs are computed once per (program, device). The
fixed runtime costs are those of :mod:`partitioner.cost.runtime_overhead`: each run of the
program first pays the device's ``call_overhead_s``, each comm op its ``comm_op_overhead_s``
(as compute: the rank's CPU runs the handler), and the step ends with a barrier over all ranks
(as comm on every rank); all measured by calibration, 0 on nominal devices.

Accounting per rank: compute = Σ compute segments; comm = time inside collectives plus the part
of a Recv wait during which the message was in flight; idle = step latency − compute − comm
(waiting for a peer to reach a collective or to start a send, and the pipeline drain).
Step latency is the makespan. Peak memory is :func:`partitioner.cost.memory.rank_peak` for the
device's runtime (``Device.runtime``): its weights (embedded in the library or mapped), the
program's peak live activations (:func:`~partitioner.cost.workdepth.peak_activation_bytes`), the
input file, the step's outputs and send copies, and the most received-but-not-yet-consumed
message bytes buffered at once; a nominal device counts weights + activations + receives. A program whose ranks wait on each other forever raises
:class:`~partitioner.core.errors.VerifyError` naming the blocked ranks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import onnx_ir as ir

if TYPE_CHECKING:  # annotations only: cluster.py builds on cost/, not the reverse
    from partitioner.cluster import Cluster, Device
from partitioner.core.errors import PlanError, VerifyError
from partitioner.cost.comm import collective_time, p2p_time, send_overhead
from partitioner.cost.memory import RankMemory, rank_peak, runtime_memory
from partitioner.cost.threads import class_thread_speedup, rank_threads
from partitioner.cost.ops import COMM_DOMAIN, itemsize, nbytes, numel, op_class
from partitioner.cost.roofline import fused_nodes, op_time
from partitioner.cost.runtime_overhead import call_seconds, comm_op_seconds, step_sync
from partitioner.cost.workdepth import constant_values, node_costs, parameter_values, peak_activation_bytes

_COLLECTIVE_KIND = {"AllReduce": "allreduce", "AllGather": "allgather", "ReduceScatter": "reducescatter",
                    "AllToAll": "alltoall", "Broadcast": "broadcast"}

_DTYPE_NAMES = {
    ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16",
    ir.DataType.INT8: "int8", ir.DataType.UINT8: "int8",
}


@dataclass(frozen=True)
class TimelineEvent:
    rank: int
    start: float
    end: float
    kind: str  # "compute" | "comm" | "idle"
    label: str

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "start": self.start, "end": self.end, "kind": self.kind, "label": self.label}


@dataclass(frozen=True)
class SimResult:
    """What the model predicts for one step of a plan (see the module docstring)."""

    num_ranks: int
    microbatches: int
    batch_size: int
    step_latency: float
    throughput: float
    compute_time: tuple[float, ...]
    comm_time: tuple[float, ...]
    idle_time: tuple[float, ...]
    peak_memory: tuple[float, ...]
    memory_capacity: tuple[float, ...]
    device_names: tuple[str, ...]
    bytes_per_level: dict[str, float] = field(hash=False)
    events: tuple[TimelineEvent, ...] = ()
    memory_terms: tuple[RankMemory, ...] = field(default=(), compare=False)

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.peak_memory, self.memory_capacity))

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        t = self.step_latency
        return tuple(i / t if t > 0 else 0.0 for i in self.idle_time)

    def to_json(self, with_events: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_ranks": self.num_ranks, "microbatches": self.microbatches, "batch_size": self.batch_size,
            "step_latency_s": self.step_latency, "throughput_samples_per_s": self.throughput,
            "fits": self.fits,
            "ranks": [
                {"rank": r, "device": self.device_names[r], "compute_s": self.compute_time[r],
                 "comm_s": self.comm_time[r], "idle_s": self.idle_time[r],
                 "peak_memory_bytes": self.peak_memory[r], "memory_capacity_bytes": self.memory_capacity[r],
                 **({"memory_terms": self.memory_terms[r].to_json()} if r < len(self.memory_terms) else {})}
                for r in range(self.num_ranks)
            ],
            "bytes_per_level": dict(self.bytes_per_level),
        }
        if with_events:
            out["events"] = [e.to_json() for e in self.events]
        return out


# ---- program compilation (once per program and device) ----------------------------------------

@dataclass(frozen=True)
class _Step:
    kind: str  # "compute" | "send" | "recv" | "coll"
    seconds: float = 0.0
    label: str = ""
    peer: int = -1
    tag: int = 0
    nbytes: float = 0.0
    coll: str = ""
    group: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Program:
    steps: tuple[_Step, ...]
    param_bytes: float  # weights embedded in the program (constants)
    activation_bytes: float
    mapped_bytes: float = 0.0  # weights kept as external data: mapped from rank<i>.data at run time
    input_bytes: float = 0.0  # the program's non-constant graph inputs, one micro-batch
    output_bytes: float = 0.0  # its graph outputs, one micro-batch
    send_bytes: float = 0.0  # bytes it sends per micro-batch (each Send copies its tensor)


def _dtype_name(node: ir.Node) -> str:
    for v in node.outputs:
        if v.dtype is not None:
            return _DTYPE_NAMES.get(v.dtype, "float32")
    return "float32"


def _attr_bytes(node: ir.Node) -> float:
    shape = node.attributes.get_ints("shape", None)
    dtype = node.attributes.get_int("dtype", 1)
    if shape is None:
        return 0.0
    n = 1
    for d in shape:
        n *= d
    try:
        size = ir.DataType(dtype).itemsize
    except (ValueError, TypeError):
        size = 4.0
    return float(n) * size


def _comm_step(node: ir.Node, rank: int, where: str) -> _Step:
    op, attrs = node.op_type, node.attributes
    tag = attrs.get_int("tag", 0)
    x = node.inputs[0] if node.inputs else None
    y = node.outputs[0] if node.outputs else None
    if op == "Send":
        peer = attrs.get_int("peer", None)
        if peer is None:
            raise VerifyError(f"{where}: Send node {node.name!r} has no 'peer' attribute")
        return _Step("send", peer=peer, tag=tag, nbytes=nbytes(x), label=f"send→{peer}")
    if op == "Recv":
        peer = attrs.get_int("peer", None)
        if peer is None:
            raise VerifyError(f"{where}: Recv node {node.name!r} has no 'peer' attribute")
        size = nbytes(y) if y is not None and numel(y) else _attr_bytes(node)
        return _Step("recv", peer=peer, tag=tag, nbytes=size, label=f"recv←{peer}")
    kind = _COLLECTIVE_KIND.get(op)
    if kind is None:
        raise VerifyError(f"{where}: unknown communication op {op!r} (node {node.name!r})")
    group = tuple(sorted(set(attrs.get_ints("group", None) or ())))
    if not group:
        raise VerifyError(f"{where}: {op} node {node.name!r} has no 'group' attribute")
    p = len(group)
    if kind == "allgather":
        size = nbytes(y) if y is not None and numel(y) else nbytes(x) * p
    elif kind == "broadcast":
        size = nbytes(y) if y is not None and numel(y) else (nbytes(x) if x is not None else _attr_bytes(node))
    else:
        size = nbytes(x) if x is not None else nbytes(y)
    return _Step("coll", coll=kind, group=group, tag=tag, nbytes=size, label=f"{kind}{list(group) if p <= 8 else f'[{p} ranks]'}")


def _segment_label(ops: list[str]) -> str:
    if len(ops) == 1:
        return ops[0]
    return f"{ops[0]}…{ops[-1]} ({len(ops)} ops)"


def compile_program(model: ir.Model, device: Device, rank: int = 0, threads: int = 1,
                    node_seconds: Mapping[str, float] | None = None) -> _Program:
    """Turn one rank's program into compute segments and comm steps (costs computed once).
    ``threads``: the rank's threads; each kernel runs faster by its class's speed-up on them
    (:func:`partitioner.cost.threads.class_thread_speedup`). ``node_seconds``: measured times of
    named nodes on the rank's build (``bench``: the convs the TVM build timed), used as they are
    in place of their roofline price."""
    graph = model.graph
    where = f"rank {rank}"
    const = constant_values(graph)
    costs = node_costs(graph, const)
    fused = fused_nodes(graph)
    steps: list[_Step] = []
    seg_time, seg_ops = 0.0, []
    comm_op = comm_op_seconds(device)
    for node, cost in zip(graph, costs):
        if node.domain == COMM_DOMAIN:
            if seg_ops:
                steps.append(_Step("compute", seconds=seg_time, label=_segment_label(seg_ops)))
                seg_time, seg_ops = 0.0, []
            if comm_op > 0:  # the call out to the comm handler (cost/runtime_overhead.py rule 3)
                steps.append(_Step("compute", seconds=comm_op, label=f"{node.op_type} call"))
            steps.append(_comm_step(node, rank, where))
            continue
        cls = op_class(node)
        t = node_seconds[node.name] if node_seconds and node.name in node_seconds else \
            op_time(cost, device, _dtype_name(node), cls, node in fused) / class_thread_speedup(device, cls, threads)
        if t > 0:
            seg_time += t
            seg_ops.append(node.op_type)
    if seg_ops:
        steps.append(_Step("compute", seconds=seg_time, label=_segment_label(seg_ops)))
    call = call_seconds(device)
    if call > 0:  # one run of the compiled program per micro-batch: argument handling, VM entry
        steps.insert(0, _Step("compute", seconds=call, label="call"))
    params = parameter_values(graph, const)
    mapped = float(sum(numel(v) * itemsize(v) for v in params if isinstance(v.const_value, ir.ExternalTensor)))
    param_bytes = float(sum(numel(v) * itemsize(v) for v in params)) - mapped
    return _Program(tuple(steps), param_bytes, peak_activation_bytes(graph, const), mapped,
                    float(sum(nbytes(v) for v in graph.inputs if v not in const)),
                    float(sum(nbytes(v) for v in graph.outputs)),
                    float(sum(s.nbytes for s in steps if s.kind == "send")))


# ---- the simulation ---------------------------------------------------------------------------

def _compile_all(programs: Sequence[ir.Model], cluster: Cluster, microbatches: int,
                 node_seconds: Sequence[Mapping[str, float]] | None = None) -> list[_Program]:
    """Check the arguments, cost every rank's program (once per distinct program and device) and
    check that every peer and group lies inside the world."""
    R = len(programs)
    if R == 0:
        raise PlanError("nothing to simulate: no per-rank programs")
    if R > cluster.size:
        raise PlanError(f"{R} per-rank programs but cluster {cluster.name!r} has only {cluster.size} devices")
    if microbatches < 1:
        raise PlanError(f"micro-batch count must be at least 1, got {microbatches}")
    cache: dict[tuple[Any, ...], _Program] = {}
    progs: list[_Program] = []
    threads = rank_threads(cluster, R)  # fewer ranks than cores: threads per rank
    for r, model in enumerate(programs):
        dev = cluster.devices[r]
        key = (id(model), tuple(sorted(dev.peak_flops.items())), dev.memory_bandwidth, dev.efficiency,
               dev.launch_overhead_s, tuple(sorted((dev.efficiency_by_class or {}).items())),
               getattr(dev, "call_overhead_s", 0.0), getattr(dev, "runtime", ""),
               getattr(dev, "comm_op_overhead_s", 0.0),
               tuple(sorted((getattr(dev, "thread_efficiency_by_class", None) or {}).items())),
               tuple(sorted(node_seconds[r].items())) if node_seconds else ())
        if key not in cache:  # data-parallel ranks share one program object: cost it once
            cache[key] = compile_program(model, dev, r, threads, node_seconds[r] if node_seconds else None)
        progs.append(cache[key])
    for r, prog in enumerate(progs):
        for s in prog.steps:
            if s.kind in ("send", "recv") and not 0 <= s.peer < R:
                raise VerifyError(f"rank {r}: {s.kind} with peer {s.peer} outside 0..{R - 1}")
            if s.kind == "coll" and any(not 0 <= g < R for g in s.group):
                raise VerifyError(f"rank {r}: {s.coll} group {list(s.group)} outside 0..{R - 1}")
            if s.kind == "coll" and r not in s.group:
                raise VerifyError(f"rank {r}: {s.coll} group {list(s.group)} does not contain rank {r}")
    return progs


def simulate(programs: Sequence[ir.Model], cluster: Cluster, microbatches: int = 1,
             batch_size: int = 1, events: bool = True, input_bytes: float | None = None,
             node_seconds: Sequence[Mapping[str, float]] | None = None) -> SimResult:
    """Simulate one step: every rank runs its program ``microbatches`` times (module docstring).

    ``batch_size`` is the number of samples one step processes (all micro-batches together);
    throughput = batch_size / step latency. ``input_bytes``: the model's whole input (every rank
    of the MPI worker reads it); None counts each rank's own micro-batches of input.
    ``node_seconds``: per rank, measured node times (:func:`compile_program`)."""
    sim = _Simulation(_compile_all(programs, cluster, microbatches, node_seconds), cluster, microbatches, events)
    sim.run()
    return sim.result(batch_size, input_bytes)


class _Simulation:
    """The event loop's state: per rank its program counter, clock, busy times and events; the
    mailboxes of sent messages and the collectives waiting for their group."""

    def __init__(self, progs: list[_Program], cluster: Cluster, microbatches: int, events: bool) -> None:
        R = len(progs)
        self.progs, self.cluster, self.m, self.events, self.R = progs, cluster, microbatches, events, R
        self.lengths = [len(p.steps) * microbatches for p in progs]
        self.pc = [0] * R
        self.now = [0.0] * R
        self.compute = [0.0] * R
        self.commt = [0.0] * R
        self.evs: list[list[TimelineEvent]] = [[] for _ in range(R)]
        self.mail: dict[tuple[int, int, int], deque[tuple[float, float, float]]] = {}
        self.blocked_on: list[Any] = [None] * R
        self.registered: list[Any] = [None] * R  # the collective a rank waits in, if any
        self.pending: dict[tuple[Any, ...], dict[int, float]] = {}
        self.occurrence: list[dict[tuple[Any, ...], int]] = [dict() for _ in range(R)]
        self.buffered: list[list[tuple[float, float, float]]] = [[] for _ in range(R)]
        self.level_bytes: dict[str, float] = {}
        self.comm_cache: dict[tuple[Any, ...], Any] = {}
        self.runnable = deque(range(R))

    def add_event(self, r: int, start: float, end: float, kind: str, label: str) -> None:
        if self.events and end > start:
            self.evs[r].append(TimelineEvent(r, start, end, kind, label))

    def run(self) -> None:
        """Run every rank until it ends or blocks; a blocked rank resumes when woken."""
        pc, lengths = self.pc, self.lengths
        while self.runnable:
            r = self.runnable.popleft()
            steps = self.progs[r].steps
            nsteps = len(steps)
            while pc[r] < lengths[r]:
                mb, i = divmod(pc[r], nsteps)
                s = steps[i]
                if s.kind == "compute":
                    self.add_event(r, self.now[r], self.now[r] + s.seconds, "compute", f"mb{mb}: {s.label}")
                    self.now[r] += s.seconds
                    self.compute[r] += s.seconds
                    pc[r] += 1
                elif s.kind == "send":
                    self._send(r, s)
                elif s.kind == "recv":
                    if not self._recv(r, s, mb):
                        break
                elif not self._collective(r, s, mb):
                    break
        self._check_deadlock()

    def _send(self, r: int, s: Any) -> None:
        key = (r, s.peer, s.tag)
        dt = p2p_time(s.nbytes, r, s.peer, self.cluster)
        self.mail.setdefault(key, deque()).append((self.now[r], self.now[r] + dt, s.nbytes))
        post = send_overhead(s.nbytes, r, s.peer, self.cluster)  # the sender posts and copies it
        if post > 0:
            self.add_event(r, self.now[r], self.now[r] + post, "comm", s.label)
            self.now[r] += post
            self.commt[r] += post
        if r != s.peer:
            name = self.cluster.link(r, s.peer).name
            self.level_bytes[name] = self.level_bytes.get(name, 0.0) + s.nbytes
        self.pc[r] += 1
        if self.blocked_on[s.peer] == key:
            self.blocked_on[s.peer] = None
            self.runnable.append(s.peer)

    def _recv(self, r: int, s: Any, mb: int) -> bool:
        """Take the message if it was sent; False (rank r blocks) if not."""
        key = (s.peer, r, s.tag)
        box = self.mail.get(key)
        if not box:
            self.blocked_on[r] = key
            return False
        sent, arrival, size = box.popleft()
        t = self.now[r]
        # a message that arrived earlier still costs the receiver its end of the transfer (the
        # same endpoint cost as posting a send); one in flight ends at its arrival
        done = max(arrival, t + send_overhead(size, s.peer, r, self.cluster))
        if sent > t:
            self.add_event(r, t, sent, "idle", f"mb{mb}: wait for {s.label}")
        begin = max(t, sent)
        if done > begin:
            self.add_event(r, begin, done, "comm", f"mb{mb}: {s.label}")
            self.commt[r] += done - begin
            self.now[r] = done
        if arrival <= t:
            self.buffered[r].append((arrival, t, size))
        self.pc[r] += 1
        return True

    def _collective(self, r: int, s: Any, mb: int) -> bool:
        """Join the collective; the last rank to arrive runs it for the group. False: r waits."""
        if self.registered[r] is not None:  # woken spuriously while waiting in a collective
            return False
        base = (s.coll, s.group, s.tag)
        k = self.occurrence[r].get(base, 0)
        ckey = (*base, k)
        waiting = self.pending.setdefault(ckey, {})
        waiting[r] = self.now[r]
        self.occurrence[r][base] = k + 1
        self.registered[r] = ckey
        if len(waiting) < len(s.group):
            self.blocked_on[r] = ckey
            return False
        del self.pending[ckey]
        start = max(waiting.values())
        cc = self.comm_cache.get((s.coll, s.nbytes, s.group))
        if cc is None:
            cc = collective_time(s.coll, s.nbytes, s.group, self.cluster)
            self.comm_cache[(s.coll, s.nbytes, s.group)] = cc
        end = start + cc.seconds
        for name, b in cc.bytes_per_level.items():
            self.level_bytes[name] = self.level_bytes.get(name, 0.0) + b
        for q, arrived in waiting.items():
            self.add_event(q, arrived, start, "idle", f"mb{mb}: wait for {s.label}")
            self.add_event(q, start, end, "comm", f"mb{mb}: {s.label} ({cc.algorithm})")
            self.commt[q] += cc.seconds
            self.now[q] = end
            self.registered[q] = None
            self.pc[q] += 1
            if q != r:
                self.blocked_on[q] = None
                self.runnable.append(q)
        return True

    def _check_deadlock(self) -> None:
        progs, pc = self.progs, self.pc
        stuck = [r for r in range(self.R) if pc[r] < self.lengths[r]]
        if stuck:
            desc = []
            for r in stuck[:6]:
                s = progs[r].steps[pc[r] % len(progs[r].steps)]
                what = (f"recv from {s.peer} tag {s.tag}" if s.kind == "recv"
                        else f"{s.coll} group {list(s.group)} tag {s.tag}")
                desc.append(f"rank {r} waits on {what} (micro-batch {pc[r] // len(progs[r].steps)})")
            raise VerifyError(f"deadlock: {'; '.join(desc)}{' ...' if len(stuck) > 6 else ''}: "
                              f"check that every Recv has a matching Send and collectives run in the same order")

    def memory(self, r: int, input_bytes: float | None) -> RankMemory:
        """Rank r's peak memory terms (:func:`partitioner.cost.memory.rank_peak`)."""
        buffered = self.buffered[r]
        deltas = sorted([(a, b) for a, _, b in buffered] + [(e, -b) for _, e, b in buffered],
                        key=lambda t: (t[0], t[1]))
        cur = peak_buf = 0.0
        for _, d in deltas:
            cur += d
            peak_buf = max(peak_buf, cur)
        p = self.progs[r]
        rule = runtime_memory(getattr(self.cluster.devices[r], "runtime", ""))
        return rank_peak(rule, embedded_weight_bytes=p.param_bytes, mapped_weight_bytes=p.mapped_bytes,
                         activation_bytes=p.activation_bytes, microbatches=self.m, local_input_bytes=p.input_bytes,
                         global_input_bytes=input_bytes or 0.0, output_bytes=p.output_bytes,
                         send_bytes=p.send_bytes, receive_bytes=peak_buf)

    def result(self, batch_size: int, input_bytes: float | None = None) -> SimResult:
        R, now, cluster = self.R, self.now, self.cluster
        end = max(now) if now else 0.0
        sync = step_sync(cluster, R)  # the barrier that ends the step (runtime_overhead rule 4)
        makespan = end + sync
        idle = []
        for r in range(R):
            self.add_event(r, now[r], end, "idle", "drain")
            self.add_event(r, end, makespan, "comm", "step barrier")
            self.commt[r] += sync
            idle.append(max(0.0, makespan - self.compute[r] - self.commt[r]))
        terms = tuple(self.memory(r, input_bytes) for r in range(R))
        all_events = tuple(e for r in range(R) for e in sorted(self.evs[r], key=lambda e: e.start))
        return SimResult(
            num_ranks=R, microbatches=self.m, batch_size=batch_size, step_latency=makespan,
            throughput=batch_size / makespan if makespan > 0 else float("inf"),
            compute_time=tuple(self.compute), comm_time=tuple(self.commt), idle_time=tuple(idle),
            peak_memory=tuple(t.total for t in terms),
            memory_capacity=tuple(cluster.devices[r].memory_bytes for r in range(R)),
            device_names=tuple(cluster.devices[r].name for r in range(R)),
            bytes_per_level=self.level_bytes, events=all_events, memory_terms=terms,
        )

