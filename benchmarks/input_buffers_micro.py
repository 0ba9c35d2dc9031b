"""Paired microbenchmark (session 16): ``TvmRankExecutable._input_buffers`` of git revision REV
(``old``) against the working tree's (``new``) on one built 200-input program (100 feeds as rule 9
tensors, 100 read-only arrays with ``reuse_readonly_inputs``: the pipeline stages' mix), 500
calls a side per round, interleaved rounds, thread CPU; prints the medians in us a call.

    .venv/bin/python benchmarks/input_buffers_micro.py REV [ROUNDS]
"""
import importlib.util, statistics, subprocess, sys, tempfile, time, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pathlib import Path
import numpy as np, onnx
from onnx import helper, TensorProto
import tvm
from backends.tvm import executable as new_mod
from backends.tvm.build import build_one
from backends.tvm.target import target_dict
old_path = Path(tempfile.mkdtemp()) / "executable_old.py"
old_path.write_text(subprocess.run(["git", "show", f"{sys.argv[1]}:backends/tvm/executable.py"], check=True,
                                   capture_output=True, text=True).stdout)
spec = importlib.util.spec_from_file_location("backends.tvm.executable_old", old_path,
                                              submodule_search_locations=None)
old_mod = importlib.util.module_from_spec(spec); old_mod.__package__ = "backends.tvm"; spec.loader.exec_module(old_mod)
n = 200
ins = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [4]) for i in range(n)]
g = helper.make_graph([helper.make_node("Sum", [f"x{i}" for i in range(n)], ["y"])], "sum200", ins,
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
d = Path(tempfile.mkdtemp()); build_one(m, d / "p.so", target_dict(None), {"threads": 1})
exe = new_mod.TvmRankExecutable(m, d / "p.so", threads=1); exe.reuse_readonly_inputs = True
feeds = {}
for i in range(n):
    a = np.full(4, i, np.float32); a.flags.writeable = False
    feeds[f"x{i}"] = tvm.runtime.tensor(a) if i % 2 else a
ref = exe.run(feeds, None)["y"].copy()
fns = {"old": old_mod.TvmRankExecutable._input_buffers, "new": new_mod.TvmRankExecutable._input_buffers}
times = {k: [] for k in fns}
print("load before", open("/proc/loadavg").read().strip())
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
    for k, f in fns.items():
        t = time.thread_time()
        for _ in range(500):
            f(exe, feeds)
        times[k].append((time.thread_time() - t) / 500 * 1e6)
print("load after", open("/proc/loadavg").read().strip())
for k, v in times.items():
    print(k, "median us per call", round(statistics.median(v), 1), "rounds", len(v))
np.testing.assert_array_equal(exe.run(feeds, None)["y"], ref)
