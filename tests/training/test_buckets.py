"""Gradient buckets AllReduced as lists, never concatenated (partitioner/training/buckets.py,
partitioner/runtime/comm_mpi.py rule 8).

The list AllReduce must give bit-identical results to the AllReduce of the concatenation: on 2
real MPI ranks, arrays whose boundaries do not fall on the ranks' halves of the slot (so a
reduced array is copied out of both ranks' slots), and a data-parallel step of an mlp whose
bucket (1.05 MiB) takes the shared-memory path, 10 SGD steps with and without the rewrite, and
with the bucket lent (overlap rule 10: the update reads the window) and not, the lent run
within rtol 1e-4, atol 1e-5 of a 1-rank run of the same global batches (ONNX Runtime).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import models_zoo
from partitioner.training import SGD, build_training_graph
from partitioner.training import buckets as buckets_mod
from partitioner.training.runner import StepRunner
from tests.mpi_script import rank_reports

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(3, 1001), (700_001,), (5,), (64, 129), ()]  # 2.8 MiB of float32, odd boundaries, a scalar
STEPS = 10


def _step(hidden: int = 32, world_size: int = 2):
    model = models_zoo.build("mlp", batch=8, layers=2, hidden=hidden, in_features=16)
    return build_training_graph(model, loss="cross_entropy", optimizer=SGD(lr=0.1), batch=4, world_size=world_size)


def _ops(exe) -> list[str]:
    from partitioner.core.segments import CommStep

    return [n.op_type for s, _ in exe.steps if not isinstance(s, CommStep) for n in s.model.graph.node]


def test_the_rank_program_has_no_bucket_concat_or_split(monkeypatch) -> None:
    """Rule 1 (knob on): every gradient goes to its AllReduce as it is, one per weight plus the
    loss, all with the bucket's tag; with ``LIST_ALLREDUCE`` off the segments concatenate and split."""
    from partitioner.runtime.comm_local import LocalWorld

    step = _step()
    world = LocalWorld(2, timeout_s=60)
    exe = StepRunner(step, comm=world.communicator(0))._exe
    comm_steps = [s for s, _ in exe.steps if s.__class__.__name__ == "CommStep"]
    weights = StepRunner(step, comm=world.communicator(1)).signature.weights
    assert len(comm_steps) == len(weights) + 1  # one bucket: each weight's gradient and the loss
    assert len({s.op.tag for s in comm_steps}) == 1 and exe.runs.count((0, 0)) == 0
    assert "Concat" not in _ops(exe) and "Split" not in _ops(exe)
    monkeypatch.setattr(buckets_mod, "LIST_ALLREDUCE", False)
    plain = StepRunner(step, comm=world.communicator(0))._exe
    assert "Concat" in _ops(plain) and "Split" in _ops(plain)


def test_a_bucket_of_another_shape_is_left_alone() -> None:
    """Rule 2: a reduced bucket read by anything but its Split keeps its concatenation."""
    import onnx
    from onnx import helper

    from partitioner.training.step import step_program

    program = step_program(_step())
    ar = next(n for n in program.graph.node if n.op_type == "AllReduce")
    program.graph.output.append(helper.make_tensor_value_info(ar.output[0], onnx.TensorProto.FLOAT, None))
    out = buckets_mod.unbucket(program)
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in program.graph.node]


def _rank_main(out: str) -> None:
    from mpi4py import MPI

    from partitioner.runtime.comm_mpi import MPICommunicator

    comm = MPICommunicator([[0, 1]])
    rank = comm.rank
    rng = np.random.default_rng(10 + rank)
    xs = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    got = comm.allreduce_list(xs, [0, 1], "sum", 9)
    flat = comm.allreduce(np.concatenate([x.reshape(-1) for x in xs]), [0, 1], "sum", 9)
    ends = np.cumsum([x.size for x in xs])[:-1]
    want = [p.reshape(x.shape) for p, x in zip(np.split(flat, ends), xs)]
    mine = [x.copy() for x in xs]  # rule 8's out=xs: reduced in place (TVM data ranks)
    back = comm.allreduce_list(mine, [0, 1], "sum", 9, out=mine)
    report = {"shapes": all(g.shape == x.shape for g, x in zip(got, xs)),
              "equal": all(np.array_equal(g, w) for g, w in zip(got, want)),
              "in_place": all(b is m for b, m in zip(back, mine))
              and all(np.array_equal(m, w) for m, w in zip(mine, want)),
              "shm_calls": comm._shm[(0, 1)].calls}
    states = {}
    data = np.random.default_rng(0)
    x, y = data.standard_normal((STEPS, 8, 16)).astype(np.float32), data.integers(0, 10, (STEPS, 8))
    step = _step(hidden=512)
    from partitioner.training import overlap

    lent = {}
    for on, lend in ((True, True), (True, False), (False, True)):  # the list with and without lending
        buckets_mod.LIST_ALLREDUCE, overlap.LEND_LAST_BUCKET = on, lend
        runner = StepRunner(step, comm=comm)
        calls = comm._shm[(0, 1)].calls
        for k in range(STEPS):
            runner.step({"input": x[k, 4 * rank:4 * rank + 4]}, y[k, 4 * rank:4 * rank + 4])
            lent[(on, lend)] = comm._shm[(0, 1)].lent  # overlap rule 10: the update read the window
        report[f"shm_steps_{on}"] = comm._shm[(0, 1)].calls - calls
        states[(on, lend)] = runner.state
    report["lent"] = [lent[(True, True)], lent[(True, False)]]
    one = StepRunner(build_training_graph(models_zoo.build("mlp", batch=8, layers=2, hidden=512, in_features=16),
                                          loss="cross_entropy", optimizer=SGD(lr=0.1)))
    for k in range(STEPS):  # the same global batches on 1 rank (ONNX Runtime, no comm op)
        one.step({"input": x[k]}, y[k])
    report["worst_vs_one_rank"] = max(float(np.max(np.abs(states[(True, True)][n] - w) - (1e-5 + 1e-4 * np.abs(w))))
                                      for n, w in one.weights().items())
    report["steps_equal"] = all(np.array_equal(states[(True, True)][n], s[n]) for s in states.values()
                                for n in states[(True, True)])
    comm.barrier()
    Path(out, f"rank{MPI.COMM_WORLD.Get_rank()}.json").write_text(json.dumps(report))


def test_list_allreduce_is_bit_identical_to_the_concatenation_on_mpi(tmp_path: Path) -> None:
    for rank, r in enumerate(rank_reports(__file__, tmp_path, timeout=300)):
        assert r["shapes"] and r["equal"] and r["in_place"] and r["steps_equal"], (rank, r)
        assert r["lent"] == [True, False], (rank, r)  # ONNX Runtime ranks lend the last bucket too
        # the list (twice) and the concatenation went through the shared window, as did each step's bucket
        assert r["shm_calls"] == 3 and r["shm_steps_True"] == STEPS and r["shm_steps_False"] == STEPS, (rank, r)
        assert r["worst_vs_one_rank"] <= 0, (rank, r)  # lent: within rtol 1e-4, atol 1e-5 of 1 rank after 10 steps


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _rank_main(sys.argv[1])
