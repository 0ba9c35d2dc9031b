"""Measure the fixed costs of a training step that the roofline does not see.

A tiny model's step is mostly not compute: the Python driver (batch slicing, the feeds dict, the
state swap), one program call per step or micro-batch (the session's entry, its input and output
handling), one kernel dispatch per node of the step graph, and a copy of every output the
backend returns. :class:`partitioner.cost.training.StepOverheads` holds those figures and the
cost model adds them (rule 7 there); this module measures them on this machine with the backend
the ranks use.

Rules:

1. Probes are ONNX Runtime programs run through the runner's own
   :class:`backends.onnxruntime.RankExecutable` (the same Python wrapper a training rank calls),
   one intra-op thread, median of ``repeat`` runs after 10 warm-up runs:
   - chain ``C(n)``: one tiny input, ``n`` Add nodes, one output:
     ``t = call + n * node + 2 * array``;
   - fan ``A(k)``: ``k`` tiny inputs, each through one Identity to its own output:
     ``t = call + k * (node + 2 * array)``;
   - output ``B``: ``A(1)`` on a 16 MiB array, run as the runner runs it (ONNX Runtime returns
     each output as a new array over a buffer it allocates: allocation and first-touch page
     faults) minus the same session writing into a bound, already touched buffer (IOBinding):
     the bytes an output costs beyond the kernel's own work, ``per_output_byte``.
   ``array`` from ``A(1)``/``A(64)`` (less the trivial node's cost from ``C(1)``/``C(201)``),
   ``call`` the rest of ``C(1)`` (each clamped at 0: a loaded machine's noise must not make a
   cost negative).
2. A tiny training step (mlp, 2 layers of 8: MatMul, Add, Relu, LogSoftmax, the gradient
   rules' Reshape/Transpose/ReduceSum, the optimizer): ``per_node`` = its program's call minus
   ``call`` and its arrays' and output bytes' costs, over its node count (a training op's
   dispatch costs several times a trivial Add's: shapes, allocation, kernel choice; the compute
   of 8-wide layers is negligible); ``per_step`` = one
   :class:`partitioner.training.runner.StepRunner` step with the loop's batch gather minus that
   call (the Python driver: feeds, state swap, the loss).
3. ``per_micro_batch``: the pipeline runner's own Python per micro-batch (slicing, feeds, the
   stash, the send/recv calls, the in-place gradient sum): a tiny 2-stage mlp pipeline
   (4 micro-batches), each stage's :class:`PipelineRunner` alone over a communicator that
   returns at once, its step minus ``per_step`` and rule 1's figures for the calls it makes
   (their real node and array counts), per micro-batch; the larger of the two stages. The
   message itself (MPI latency) is the link's calibrated ``alpha``, not counted here.
4. The TVM backend: its per-call cost is the cluster's calibrated ``call_overhead_s`` (VM entry,
   argument copies; ``partitioner calibrate --backend tvm``) and its per-kernel cost is already in
   the roofline (``launch_overhead_s``, fused kernels); the Python driver (rule 2) and the
   output bytes are the same as ONNX Runtime's.
4. Figures measured on a loaded machine are upper bounds (another process's time slices land
   inside the medians): calibrate on a quiet one.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from partitioner.cost.training import StepOverheads


def _model(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str], shape: list[int]) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in outputs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def chain(n: int) -> onnx.ModelProto:
    """Rule 1's ``C(n)``."""
    names = ["x"] + [f"c{i}" for i in range(n)]
    return _model([helper.make_node("Add", [names[i], names[i]], [names[i + 1]]) for i in range(n)], ["x"],
                  [names[-1]], [1])


def fan(k: int, elements: int = 1) -> onnx.ModelProto:
    """Rule 1's ``A(k)`` (``elements`` per array)."""
    return _model([helper.make_node("Identity", [f"x{i}"], [f"y{i}"]) for i in range(k)], [f"x{i}" for i in range(k)],
                  [f"y{i}" for i in range(k)], [elements])


def _median_run(program: onnx.ModelProto, repeat: int) -> float:
    from backends.onnxruntime import RankExecutable

    exe = RankExecutable(program, threads=1)
    feeds = {v.name: np.ones([d.dim_value for d in v.type.tensor_type.shape.dim], np.float32)
             for v in program.graph.input}
    times = []
    for i in range(repeat + 10):
        t0 = time.perf_counter()
        exe.run(feeds, None)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _output_cost(repeat: int) -> float:
    """Rule 1's ``B``: seconds per returned output byte beyond the kernel's own work."""
    import onnxruntime as ort

    elements = 4 * 2**20
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(fan(1, elements).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x, buf = np.ones(elements, np.float32), np.zeros(elements, np.float32)
    io = sess.io_binding()
    io.bind_cpu_input("x0", x)
    io.bind_output("y0", "cpu", 0, np.float32, [elements], buf.ctypes.data)

    def median(fn: Any) -> float:
        times = []
        for i in range(repeat + 3):
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    fresh = median(lambda: sess.run(["y0"], {"x0": x}))
    bound = median(lambda: sess.run_with_iobinding(io))
    return max(0.0, (fresh - bound) / (4 * elements))


def _driver_step(repeat: int) -> tuple[float, float, int, int, float]:
    """Rule 2's tiny step: median seconds of one StepRunner step with the loop's batch gather, of
    its program's call alone, and the program's nodes, arrays and output bytes."""
    import models_zoo
    from partitioner.training.optimizers import SGD
    from partitioner.training.runner import StepRunner
    from partitioner.training.step import build_training_graph, step_program

    model = models_zoo.build("mlp", batch=4, layers=2, hidden=8, in_features=8)
    step = build_training_graph(model, loss="cross_entropy", optimizer=SGD(lr=1e-3))
    runner = StepRunner(step, backend="onnxruntime")
    prog = step_program(step)
    x = np.ones((16, 8), np.float32)
    y = np.zeros(16, np.int64)
    idx = np.arange(4)
    sig = runner.signature

    def loop_step() -> None:
        runner.step({sig.data[0]: x[idx].astype(np.float32, copy=False)}, y[idx])

    feeds = {sig.data[0]: x[idx], sig.labels: y[idx], **{a: runner.state[a] for a, _ in sig.state}}
    t_step = _median(loop_step, repeat)
    t_call = _median(lambda: runner._exe.run(feeds, runner.comm), repeat)
    out_bytes = sum(int(np.prod([d.dim_value for d in v.type.tensor_type.shape.dim] or [1])) * 4
                    for v in prog.graph.output)
    arrays = len(prog.graph.input) + len(prog.graph.output)
    return t_step, t_call, len(prog.graph.node), arrays, float(out_bytes)


def _median(fn: Any, repeat: int, warmup: int = 10) -> float:
    times = []
    for i in range(repeat + warmup):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@functools.lru_cache(maxsize=4)
def calibrate(backend: str = "onnxruntime", repeat: int = 200) -> StepOverheads:
    """Rules 1-3 (cached per process: about a second)."""
    c1 = _median_run(chain(1), repeat)
    a1, a64 = _median_run(fan(1), repeat), _median_run(fan(64), repeat)
    add = max(0.0, (_median_run(chain(201), repeat) - c1) / 200)  # a trivial node (rule 1)
    array = max(0.0, ((a64 - a1) / 63 - add) / 2)
    call = max(0.0, c1 - add - 2 * array)
    per_byte = _output_cost(max(10, repeat // 10))
    t_step, t_call, nodes, arrays, out_bytes = _driver_step(repeat)
    node = max(add, (t_call - call - arrays * array - out_bytes * per_byte) / nodes)  # a training op (rule 2)
    per_step = max(0.0, t_step - t_call)
    probe = StepOverheads(per_step_s=per_step, per_call_s=call, per_node_s=node, per_array_s=array,
                          per_output_byte_s=per_byte)
    per_mb = _micro_batch_driver(probe, max(20, repeat // 4))
    if backend == "tvm":  # rule 4
        from partitioner.cluster import resolve_cluster

        dev = resolve_cluster("cpu:1", "tvm").devices[0]
        return StepOverheads(per_step_s=per_step, per_call_s=dev.call_overhead_s, per_node_s=0.0,
                             per_array_s=array, per_output_byte_s=per_byte, per_micro_batch_s=per_mb, backend="tvm")
    return StepOverheads(per_step_s=per_step, per_call_s=call, per_node_s=node, per_array_s=array,
                         per_output_byte_s=per_byte, per_micro_batch_s=per_mb, backend="onnxruntime")


class _Instant:
    """A communicator whose sends vanish and whose receives return zeros at once (rule 3)."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        pass

    def recv(self, src: int, tag: int, shape: Any, dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def broadcast(self, array: Any, ranks: Any, root: int, tag: int) -> np.ndarray:
        return array if array is not None else np.zeros(1)


def _micro_batch_driver(costs: StepOverheads, repeat: int) -> float:
    """Rule 3: the pipeline runner's Python per micro-batch, beyond its program calls."""
    import models_zoo
    from partitioner.training.optimizers import SGD
    from partitioner.training.pipeline import build_pipeline
    from partitioner.training.pipeline_runner import PipelineRunner

    m = 4
    model = models_zoo.build("mlp", batch=8, layers=2, hidden=8, in_features=8)
    plan = build_pipeline(model, "cross_entropy", SGD(lr=1e-3), batch=8, stages=2, micro_batches=m, schedule="1f1b")
    x, y = np.ones((8, 8), np.float32), np.zeros(8, np.int64)
    worst = 0.0
    for s in range(2):
        runner = PipelineRunner(plan, s, comm=_Instant(s))
        name = plan.stages[0].data[0] if plan.stages[0].data else "input"
        times = []
        for i in range(repeat + 5):
            t0 = time.perf_counter()
            runner.step({name: x}, y)
            if i >= 5:
                times.append(time.perf_counter() - t0)
        st = plan.stages[s]
        per_mb_calls = [p for p in (st.forward, st.backward, st.fused) if p is not None]
        calls = m * sum(_call_cost(costs, p) for p in per_mb_calls) + _call_cost(costs, st.update)
        worst = max(worst, (statistics.median(times) - costs.per_step_s - calls) / m)
    return max(0.0, worst)


def _call_cost(costs: StepOverheads, program: onnx.ModelProto) -> float:
    """Rule 1's figures for one call of ``program`` (its nodes, arrays, output bytes)."""
    g = program.graph
    out = sum(int(np.prod([d.dim_value for d in v.type.tensor_type.shape.dim] or [1])) * 4 for v in g.output)
    return costs.call(len(g.node), len(g.input) + len(g.output), float(out))


def step_node_counts(model: Any, batch: int, loss: str, optimizer: Any, names: list[str], step: Any = None
                     ) -> tuple[np.ndarray, int, int]:
    """The training step's nodes per forward node (its own node and its backward nodes; a
    rewritten node, such as BatchNormalization's expansion, spread evenly), the loss's nodes and
    the optimizer's; ``names``: the forward graph's node names in order
    (:func:`partitioner.cost.training.profile`); ``step``: that step, when already built."""
    from partitioner.training.step import build_training_graph

    if step is None:
        step = build_training_graph(model, loss=loss, optimizer=optimizer, batch=batch)
    index = {n: i for i, n in enumerate(names)}
    counts = np.zeros(len(names))
    loss_nodes = optimizer_nodes = other = 0
    for node in step.graph:
        key = node.metadata_props.get("training.forward_node", node.name)
        if key in index:
            counts[index[key]] += 1
        elif key == "loss":
            loss_nodes += 1
        elif key == "optimizer":
            optimizer_nodes += 1
        else:  # a rewritten node (BatchNormalization's expansion): spread evenly
            other += 1
    counts += other / max(1, len(names))
    return counts, loss_nodes, optimizer_nodes


def figures(overheads: StepOverheads) -> dict[str, float]:
    """The figures in microseconds (for reports)."""
    return {k: (v * 1e6 if isinstance(v, float) else v) for k, v in overheads.to_json().items()}
