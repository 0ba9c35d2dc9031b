"""Convolution algorithms for the CPU pipeline: direct, im2col+GEMM, Winograd F(m x m, 3 x 3).

The survey (Ben-Nun & Hoefler, section 4.2) lists three ways to compute a convolution. The
backend builds all of them from TE and schedules them with the same default rules
(:mod:`backends.tvm.schedules`), so they compete on equal terms:

- ``direct``: ``relax.nn.conv2d`` as TVM legalizes it (NHWC, HWIO): one reduction over
  (kh, kw, ci), register-tiled by :class:`~backends.tvm.schedules.Contraction`;
- ``im2col``: a ``[N*OH*OW, KH*KW*C]`` patch matrix (an injective gather), then one GEMM with
  the ``[KH*KW*C, CO]`` weights. Any kernel, stride, padding and dilation; ``groups == 1``;
- ``winograd`` (tile ``m`` = 4, so F(4x4, 3x3)): input transform ``B^T d B``, ``(m+2)^2``
  batched GEMMs over channels, output transform ``A^T M A``. Only 3x3, stride 1, dilation 1,
  ``groups == 1``; the weight transform ``G g G^T`` runs at compile time (the weights are
  constants, folded by ``FoldConstant``).

Rules:

1. Choose, then rewrite: :func:`choose_algorithms` (the choice step; it reads the module and
   changes nothing) names an algorithm per distinct eligible conv; :func:`apply_algorithms`
   (the rewrite step, a Relax mutation after ``ConvertLayout`` and ``FoldConstant``) replaces each
   chosen ``relax.nn.conv2d`` (NHWC data, HWIO constant weights, float32) by that algorithm's TE
   stages; its output has the conv's shape and layout, so the epilogue (bias, batch-norm
   affine, ReLU) still fuses into the last stage. :func:`rewrite_convolutions` runs both.
2. The choice (build option ``conv_algorithm``): ``"auto"`` (the default,
   :data:`DEFAULT_ALGORITHM`), ``"direct"`` (nothing is rewritten), ``"im2col"``, ``"winograd"``
   (where eligible; otherwise direct). ``"auto"`` chooses by measurement, like cuDNN's ``Find``:
   every distinct eligible conv (shape, stride, dilation, padding, and the thread count the build
   is for) is built alone with each eligible algorithm and the default schedules, and timed on
   this machine (:func:`_time_candidates`; thread CPU time for 1-thread builds). Why measure: which algorithm wins depends on the
   shape, the threads and the machine (session 13, quiet run: resnet18 batch 8 took 1.02x of ONNX
   Runtime's time with direct convs and 0.85x with ``auto`` on 1 thread, 1.03x and 0.94x on 2;
   some 3x3 convs are faster direct). Robust on a loaded machine: the candidates are timed
   interleaved (A B C, B C A, C A B, ..., :data:`AUTO_ROUNDS` rounds, each round long enough to
   dwarf the clock; with :data:`AUTO_FLUSH_BYTES`, 3x the rounds of one call each, after writing
   that many bytes so the conv's weights and input are out of the caches, as inside a model:
   timed hot, back to back, Winograd won alone on resnet50's batch-1 3x3 convs and the model lost
   13-18%, session 14), so a burst of load from another process hits every candidate alike, and the medians
   are compared; a non-direct algorithm is kept only when its median beats direct's by
   :data:`AUTO_MARGIN` (5%): below that the difference is within what the interleaved medians
   still vary by under load, and direct is the algorithm the rest of the backend (tuning, fusion,
   the default schedules) has been measured with. The measured times are cached per process and on disk
   (the choice is made from them at each build, with the margin in force then; a file entry
   without times keeps its ``fastest``):
   in ``<tuning db>/<target key>/conv_algorithms.json`` when a tuning database is given, else in
   this machine's cache (:func:`machine_cache_file`: ``$PARTITIONER_CACHE_DIR/tvm/<cpu>-<cores>c-
   <target key>/conv_algorithms.json``, :mod:`partitioner.calibrate_cache` rule 5), so a second
   compile of the same model, in a new process, measures nothing. The file is merged, never
   overwritten (re-read, updated, written to a temporary file and renamed); one that does not
   parse is ignored with a one-line warning and rewritten. Each entry records the fingerprint of
   what the candidates were built with (:func:`schedules_fingerprint`: TVM's version, the code of
   :data:`SCHEDULE_MODULES` without comments and docstrings, their upper-case settings, and the
   parallel threshold in force); an entry with times and another fingerprint (or none, written
   before session 30) is measured again, so a changed schedule, setting or TVM never picks from
   times of the old code (session 28 changed the direct conv's tile on Zen 5 and the cache kept
   choosing from times measured before). To measure again otherwise, delete the file.
   The build facts record the choice per conv and where it came from (``conv_choices``).
   Convs that are not eligible (weights that are graph inputs, as in training graphs; grouped or
   depthwise convs; non-float32) are never measured: a build where no conv is rewritten returns
   the module exactly as ``direct`` does.
3. Every algorithm computes the same convolution; Winograd rounds differently (relative error
   ~1e-6 in float32 for F(4x4, 3x3) on unit-scale data, checked against ONNX Runtime in tests).
4. Transposed convolutions whose kernel equals their stride (U-Net's 2x2/2 upsampling) are
   always rewritten as one GEMM + pixel shuffle (:func:`conv_transpose_as_matmul`, knob
   :data:`CONV_TRANSPOSE_AS_MATMUL`), in every build: the pipeline runs it after ``FoldConstant``
   and before batch-norm folding and ``LegalizeOps`` (:func:`backends.tvm.pipeline.legalize_passes`).
5. Winograd's input transform gathers its tiles from the padded input inside the transform's
   reduction (:data:`WINOGRAD_DATA_GATHER`, :func:`winograd_data_te`) instead of copying them
   into a ``[m+2, m+2, tiles, C]`` buffer first. Shapes it is for: every Winograd conv; measured
   on the ones ``auto`` picks here at batch 1 (ResNet-18's 3x3 256 -> 256 on 7x7: 10x10x256
   padded input, 36 x 4 tiles x 256 channels). The copy was a parallel loop of its own between
   the pad and the transform: one more fork/join, 147 KiB written and read back, and on 2
   threads each stage split differently, so the transform read tiles the other core had
   written; the kernel took 57 us on 1 thread and 65-68 on 2 (``kernel_profile.py --scaling
   --conv-algorithm auto``, resnet18 b1, session 15). The gathered read is still contiguous
   along the channels (the vector axis), so the Contraction rule schedules it as before.
   Measured (session 15, load ~10, paired with the knob off; docs/per_device_speed.md,
   "resnet18 at batch 1 on 2 threads (session 15)"): resnet18 b1's ``winograd_data`` 0.77-0.80x
   on 2 threads and 0.80-0.83x on 1 (each call's minimum over 30 interleaved rounds); whole
   Winograd convs alone, batch 1, cold caches, 41-61 interleaved calls, new / old median (10th
   percentile): 256 ch on 7x7 0.99 (0.96) on 1 thread, 0.91 (0.94) on 2; 512 on 7x7 0.97
   (0.98), 1.005 (0.96); 256 on 14x14 0.94 (0.93), 1.02 (0.96); 128 on 28x28 0.99 (0.95),
   0.86 (0.85). Reading the unpadded input with bounds checks as well (no pad stage) was mixed
   in the same setting (512 on 7x7 1.32x slower on 1 thread) and is not done.
6. What a built conv costs (:func:`measured_conv_seconds`, read by ``partitioner bench``): the
   cache keeps every candidate's measured seconds, so a built rank's convs can be priced at the
   time of the algorithm its build chose instead of the cost model's roofline, which prices
   every conv as a direct one at the calibrated ``conv`` class value. Measured (session 23, Zen 4,
   zoo resnet at 224x224, batch 4, 1 thread, ``benchmarks/kernel_profile.py``): the 3x3 convs
   priced 139 ms, their kernels (most of them Winograd) 102 ms.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from partitioner.core.errors import BackendError

ALGORITHMS = ("direct", "im2col", "winograd", "auto")
#: the algorithm of a build whose options name none (rule 2); "direct" restores the old default
DEFAULT_ALGORITHM = "auto"
#: the environment variable that overrides :data:`DEFAULT_ALGORITHM` (the test suite pins "direct")
DEFAULT_ENV = "PARTITIONER_CONV_ALGORITHM"
#: a non-direct algorithm is kept only when its median is this much below direct's (rule 2)
AUTO_MARGIN = 0.05
#: interleaved timing rounds per candidate, and the least time one round of one candidate takes
AUTO_ROUNDS = 7
AUTO_ROUND_S = 0.004
#: bytes written between timed calls so each candidate runs with cold caches (0: hot, back to back)
AUTO_FLUSH_BYTES = 64 << 20
WINOGRAD_TILE = 4
#: the input transform reads its (m+2)^2 tiles straight from the padded input (:func:`winograd_data_te`,
#: rule 5); off: the tiles are first copied into a ``winograd_tile`` buffer, as before
WINOGRAD_DATA_GATHER = True
CACHE_FILE = "conv_algorithms.json"
_MEASURED: dict[tuple[str, str], dict[str, float]] = {}  # (fingerprint, conv key) -> each candidate's seconds
#: the modules whose code and settings decide how fast a candidate runs (rule 2's fingerprint)
SCHEDULE_MODULES = ("backends.tvm.conv_algorithms", "backends.tvm.pipeline", "backends.tvm.parallel_scope",
                    "backends.tvm.schedules.contraction", "backends.tvm.schedules.depthwise",
                    "backends.tvm.schedules.gemm_packed", "backends.tvm.schedules.injective",
                    "backends.tvm.schedules.rowwise", "backends.tvm.schedules.threads",
                    "backends.tvm.schedules.transpose_tiles", "backends.tvm.schedules.vector")
_CODE_DIGESTS: dict[str, str] = {}


def default_algorithm() -> str:
    """``$PARTITIONER_CONV_ALGORITHM`` or :data:`DEFAULT_ALGORITHM` (a bad value: BackendError)."""
    import os

    value = os.environ.get(DEFAULT_ENV, "").strip() or DEFAULT_ALGORITHM
    if value not in ALGORITHMS:
        raise BackendError(f"{DEFAULT_ENV}={value!r} is not a conv algorithm; use one of {', '.join(ALGORITHMS)}")
    return value


def machine_cache_file(target: Any) -> Path:
    """This machine's file of measured choices for ``target`` (rule 2)."""
    from partitioner.calibrate_cache import target_cache_dir

    from .tuning import target_key

    return target_cache_dir(target_key(target)) / CACHE_FILE


def im2col_te(data: Any, weight: Any, strides, padding, dilation) -> Any:
    """Conv2d NHWC x HWIO as im2col + GEMM. ``weight`` is a TE tensor [KH, KW, C, CO]."""
    from tvm import te, topi

    n, h, w, c = (int(d) for d in data.shape)
    kh, kw, _, co = (int(d) for d in weight.shape)
    (sh, sw), (dh, dw) = strides, dilation
    pt, pl, pb, pr = padding
    oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    pad = topi.nn.pad(data, [0, pt, pl, 0], [0, pb, pr, 0], name="pad") if any(padding) else data
    k_len = kh * kw * c
    cols = te.compute((n * oh * ow, k_len),
                      lambda p, k: pad[p // (oh * ow), (p // ow) % oh * sh + k // (kw * c) * dh,
                                       p % ow * sw + (k // c) % kw * dw, k % c], name="im2col")
    w2 = te.compute((k_len, co), lambda k, o: weight[k // (kw * c), (k // c) % kw, k % c, o], name="weight_matrix")
    r = te.reduce_axis((0, k_len), "k")
    gemm = te.compute((n * oh * ow, co), lambda p, o: te.sum(cols[p, r] * w2[r, o], axis=[r]), name="im2col_gemm")
    return te.compute((n, oh, ow, co), lambda b, i, j, o: gemm[(b * oh + i) * ow + j, o], name="im2col_out")


def winograd_kernel_te(weight: Any, m: int = WINOGRAD_TILE) -> Any:
    """The transformed weights ``G g G^T``: [m+2, m+2, C, CO] (run on constants at compile time)."""
    from tvm import te
    from tvm.topi.nn.winograd_util import winograd_transform_matrices

    _, _, c, co = (int(d) for d in weight.shape)
    alpha = m + 2
    _, _, g = winograd_transform_matrices(m, 3, "float32")
    rh, rw = te.reduce_axis((0, 3), "rh"), te.reduce_axis((0, 3), "rw")
    return te.compute((alpha, alpha, c, co),
                      lambda e, v, ci, o: te.sum(g[e, rh] * weight[rh, rw, ci, o] * g[v, rw], axis=[rh, rw]),
                      name="winograd_kernel")


def winograd_data_te(data: Any, padding, m: int = WINOGRAD_TILE) -> Any:
    """The transformed input tiles ``B^T d B``: [m+2, m+2, tiles, C]."""
    from tvm import te, topi
    from tvm.topi.nn.winograd_util import winograd_transform_matrices

    n, h, w, c = (int(d) for d in data.shape)
    pt, pl, pb, pr = padding
    oh, ow = h + pt + pb - 2, w + pl + pr - 2
    nh, nw = (oh + m - 1) // m, (ow + m - 1) // m
    alpha, tiles = m + 2, n * nh * nw
    # pad so that every tile of (m+2)^2 input pixels is in range
    pad = topi.nn.pad(data, [0, pt, pl, 0], [0, nh * m + 2 - h - pt, nw * m + 2 - w - pl, 0], name="pad")
    _, b, _ = winograd_transform_matrices(m, 3, "float32")
    ra, rb = te.reduce_axis((0, alpha), "ra"), te.reduce_axis((0, alpha), "rb")
    if WINOGRAD_DATA_GATHER:  # rule 5: no tile buffer
        return te.compute((alpha, alpha, tiles, c),
                          lambda e, v, p, ci: te.sum(pad[p // (nh * nw), (p // nw) % nh * m + ra, p % nw * m + rb, ci]
                                                     * b[ra, e] * b[rb, v], axis=[ra, rb]),
                          name="winograd_data")
    tile = te.compute((alpha, alpha, tiles, c),
                      lambda e, v, p, ci: pad[p // (nh * nw), (p // nw) % nh * m + e, p % nw * m + v, ci],
                      name="winograd_tile")
    return te.compute((alpha, alpha, tiles, c),
                      lambda e, v, p, ci: te.sum(tile[ra, rb, p, ci] * b[ra, e] * b[rb, v], axis=[ra, rb]),
                      name="winograd_data")


def winograd_gemm_te(data_t: Any, kernel_t: Any) -> Any:
    """``(m+2)^2`` GEMMs over channels: [m+2, m+2, tiles, CO]."""
    from tvm import te

    alpha, _, tiles, c = (int(d) for d in data_t.shape)
    co = int(kernel_t.shape[3])
    ci = te.reduce_axis((0, c), "ci")
    return te.compute((alpha, alpha, tiles, co),
                      lambda e, v, p, o: te.sum(data_t[e, v, p, ci] * kernel_t[e, v, ci, o], axis=[ci]),
                      name="winograd_gemm")


def winograd_output_te(prod: Any, out_shape, m: int = WINOGRAD_TILE) -> Any:
    """The output transform ``A^T M A``, cropped to the conv's NHWC output shape."""
    from tvm import te
    from tvm.topi.nn.winograd_util import winograd_transform_matrices

    alpha, _, tiles, co = (int(d) for d in prod.shape)
    n, oh, ow, _ = out_shape
    nh, nw = (oh + m - 1) // m, (ow + m - 1) // m
    a, _, _ = winograd_transform_matrices(m, 3, "float32")
    ra, rb = te.reduce_axis((0, alpha), "ra"), te.reduce_axis((0, alpha), "rb")
    inv = te.compute((m, m, tiles, co),
                     lambda i, j, p, o: te.sum(prod[ra, rb, p, o] * a[ra, i] * a[rb, j], axis=[ra, rb]),
                     name="winograd_inverse")
    return te.compute((n, oh, ow, co), lambda b, i, j, o: inv[i % m, j % m, (b * nh + i // m) * nw + j // m, o],
                      name="winograd_out")


def _conv_params(call: Any, weight: Any) -> dict[str, Any] | None:
    """Eligibility and parameters of a ``relax.nn.conv2d`` call whose weight (resolved through
    its binding) is ``weight`` (None: leave it direct)."""
    a = call.attrs
    if str(a.data_layout) != "NHWC" or str(a.kernel_layout) != "HWIO" or str(a.out_layout) != "NHWC":
        return None
    if int(a.groups) != 1:
        return None
    data = call.args[0]
    if weight is None or type(weight).__name__ not in ("GenericConst", "Constant"):  # not a constant: cannot transform it ahead
        return None
    try:
        dshape = [int(d) for d in data.ty.shape.values]
        wshape = [int(d) for d in weight.ty.shape.values]
    except (TypeError, ValueError, AttributeError):
        return None
    if str(data.ty.dtype) != "float32" or str(weight.ty.dtype) != "float32" or (a.out_dtype and str(a.out_dtype) not in ("", "float32")):
        return None
    strides = tuple(int(s) for s in a.strides)
    dilation = tuple(int(s) for s in a.dilation)
    padding = tuple(int(p) for p in a.padding)
    out_shape = [int(d) for d in call.ty.shape.values]
    winograd_ok = wshape[:2] == [3, 3] and strides == (1, 1) and dilation == (1, 1) and wshape[3] >= 8
    im2col_ok = wshape[0] * wshape[1] > 1  # a 1x1 conv is already a GEMM
    if not (winograd_ok or im2col_ok):
        return None
    return {"data": dshape, "weight": wshape, "strides": strides, "dilation": dilation, "padding": padding,
            "out": out_shape, "winograd": winograd_ok, "im2col": im2col_ok}


def _code_digest(module: Any) -> str:
    """A digest of ``module``'s code: its syntax tree without docstrings (comments are not in it),
    so an edit of the prose does not make every conv measured again."""
    import ast
    import hashlib
    import inspect

    name = module.__name__
    if name not in _CODE_DIGESTS:
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        _CODE_DIGESTS[name] = hashlib.sha256(ast.dump(tree).encode()).hexdigest()
    return _CODE_DIGESTS[name]


def schedules_fingerprint() -> str:
    """What the cached times were measured with (rule 2): TVM's version, the code of
    :data:`SCHEDULE_MODULES`, the values of their upper-case module settings (the environment
    knobs, and what ``--build-baseline MODULE.ATTR=VALUE`` sets) and the parallel threshold."""
    import hashlib
    import importlib

    import tvm

    from .schedules.threads import parallel_min_flops

    h = hashlib.sha256(f"tvm {tvm.__version__}".encode())
    for name in SCHEDULE_MODULES:
        module = importlib.import_module(name)
        h.update(f"{name} {_code_digest(module)}".encode())
        for attr, value in sorted(vars(module).items()):
            if attr.isupper() and isinstance(value, (bool, int, float, str, tuple)):
                h.update(f"{attr}={value!r}".encode())
    h.update(f"parallel_min_flops={parallel_min_flops()!r}".encode())
    return h.hexdigest()[:16]


def _key(p: dict[str, Any]) -> str:
    """Shape, stride, dilation, padding and the build's thread count (None: the pool's default)."""
    from .schedules.threads import build_threads

    return json.dumps([p["data"], p["weight"], p["strides"], p["dilation"], p["padding"],
                       {"threads": build_threads()}])


def _emit(bb: Any, algorithm: str, data: Any, weight: Any, p: dict[str, Any]) -> Any:
    if algorithm == "im2col":
        return bb.emit_te(im2col_te, data, weight, p["strides"], p["padding"], p["dilation"],
                          primfunc_name_hint="im2col_conv2d")
    k = bb.emit_te(winograd_kernel_te, weight, primfunc_name_hint="winograd_kernel")
    d = bb.emit_te(winograd_data_te, data, p["padding"], primfunc_name_hint="winograd_data")
    g = bb.emit_te(winograd_gemm_te, d, k, primfunc_name_hint="winograd_gemm")
    return bb.emit_te(winograd_output_te, g, p["out"], primfunc_name_hint="winograd_output")


def _candidates(p: dict[str, Any]) -> list[str]:
    return ["direct"] + [a for a in ("im2col", "winograd") if p[a]]


def _build_alone(p: dict[str, Any], algorithm: str, target: Any) -> Any:
    """One conv (+ReLU) built with ``algorithm`` and the default schedules: a callable run."""
    import tvm
    from tvm import relax

    from . import parallel_scope
    from .pipeline import run_pipeline

    rng = np.random.default_rng(0)
    w_np = (rng.standard_normal(p["weight"]) / np.sqrt(np.prod(p["weight"][:3]))).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(p["data"], "float32"))
    with bb.function("main", [x]):
        w = relax.const(w_np)
        if algorithm == "direct":
            y = bb.emit(relax.op.nn.conv2d(x, w, strides=p["strides"], padding=p["padding"], dilation=p["dilation"],
                                           data_layout="NHWC", kernel_layout="HWIO"))
        else:
            y = _emit(bb, algorithm, x, w, p)
        bb.emit_func_output(bb.emit(relax.op.nn.relu(y)))
    mod = bb.get()
    with target:
        mod = relax.transform.FoldConstant()(mod)
    vm = relax.VirtualMachine(parallel_scope.compile(run_pipeline(mod, "scheduled", target), target), tvm.cpu())
    xt = tvm.runtime.tensor(rng.standard_normal(p["data"]).astype(np.float32))
    return lambda: vm["main"](xt)


def _clock() -> Any:
    """The timing clock: the calling thread's CPU time for a 1-thread build (its kernels have no
    parallel loops, so that is all their work, and a time slice lost to another process is not
    counted: on the loaded 2-core machine single 2-6 ms calls were preempted often enough to flip
    a choice), wall time otherwise (the pool's workers' time is not the calling thread's)."""
    from .schedules.threads import build_threads

    return time.thread_time if build_threads() == 1 else time.perf_counter


def _time_candidates(p: dict[str, Any], target: Any) -> dict[str, float]:
    """Median seconds per call of every eligible algorithm for conv ``p``, timed interleaved
    (rule 2): each candidate is built and warmed up, then :data:`AUTO_ROUNDS` rounds time each
    candidate in turn for ``reps`` calls (``reps`` makes direct's round last
    :data:`AUTO_ROUND_S`); the order rotates every round, so no candidate always runs first after
    another's data left the caches. Clock: :func:`_clock`. The module hook tests count calls of."""
    runs = {a: _build_alone(p, a, target) for a in _candidates(p)}
    for run in runs.values():
        run()
    clock = _clock()
    t0 = clock()
    runs["direct"]()
    reps = max(1, min(1000, int(AUTO_ROUND_S / max(clock() - t0, 1e-7))))
    flush = np.zeros(AUTO_FLUSH_BYTES // 8) if AUTO_FLUSH_BYTES else None
    rounds = AUTO_ROUNDS if flush is None else 3 * AUTO_ROUNDS
    names = list(runs)
    per: dict[str, list[float]] = {a: [] for a in runs}
    for r in range(rounds):
        for a in names[r % len(names):] + names[:r % len(names)]:
            if flush is not None:  # one cold call: weights and input out of the caches, as in a model
                flush += 1.0
                t0 = clock()
                runs[a]()
                per[a].append(clock() - t0)
                continue
            t0 = clock()
            for _ in range(reps):
                runs[a]()
            per[a].append((clock() - t0) / reps)
    return {a: statistics.median(ts) for a, ts in per.items()}


def pick(times: dict[str, float]) -> str:
    """The fastest candidate, but direct unless the winner beats it by :data:`AUTO_MARGIN`."""
    best = min(times, key=times.get)
    return best if times[best] < (1.0 - AUTO_MARGIN) * times["direct"] else "direct"


def _read_cache(cache_file: Path) -> dict[str, Any]:
    """The cache file's entries; {} when missing, and when unreadable (warned once, rule 2)."""
    from partitioner.calibrate_cache import read_json_object

    return read_json_object(cache_file, "conv algorithm cache", "convs are measured again") or {}


def _save_entry(cache_file: Path, key: str, entry: dict[str, Any]) -> None:
    """Merge one entry into the cache file: re-read, update, write a temporary file, rename."""
    import os

    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        disk = _read_cache(cache_file)
        disk[key] = entry
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(disk, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, cache_file)  # readers never see a half-written file
    except OSError:
        pass  # a cache that cannot be written only costs a re-measurement


def measure(p: dict[str, Any], target: Any, cache_file: Path | None = None) -> tuple[str, str]:
    """``(algorithm, source)`` for conv ``p`` on this machine: source ``"process"`` (measured
    earlier in this process), ``"cache"`` (read from ``cache_file``) or ``"measured"``."""
    key = _key(p)
    fingerprint = schedules_fingerprint()
    if (fingerprint, key) in _MEASURED:  # the choice is made from the times each call: AUTO_MARGIN is read now
        return pick(_MEASURED[fingerprint, key]), "process"
    if cache_file is not None:
        entry = _read_cache(cache_file).get(key)
        times = entry.get("seconds") if isinstance(entry, dict) else None
        if isinstance(times, dict) and "direct" in times and set(times) <= set(_candidates(p)):
            if entry.get("schedules") == fingerprint:  # else measured with other code: measured again
                _MEASURED[fingerprint, key] = {a: float(t) for a, t in times.items()}
                return pick(_MEASURED[fingerprint, key]), "cache"
        elif isinstance(entry, dict) and entry.get("fastest") in _candidates(p):  # a file with no times
            return entry["fastest"], "cache"
    times = _time_candidates(p, target)
    _MEASURED[fingerprint, key] = times
    if cache_file is not None:
        _save_entry(cache_file, key, {"fastest": pick(times), "seconds": times, "margin": AUTO_MARGIN,
                                      "schedules": fingerprint})
    return pick(times), "measured"


def measured_conv_seconds(program: Any, choices: list[dict[str, Any]], cache_file: Path) -> dict[str, float]:
    """Rule 6: per Conv node of ``program`` (an ONNX rank program, NCHW) whose conv the build
    chose an algorithm for (``choices``: the build facts' ``conv_choices``), the seconds this
    machine's cache (rule 2) measured for that algorithm, by node name. The key is the one
    :func:`_key` gives the TVM conv after ``ConvertLayout``: the input as NHWC, the weight as
    HWIO, strides, dilations, pads (top, left, bottom, right) and the build's thread count (read
    from the choices' keys). Nodes whose conv has no choice or no cached seconds are absent: the
    cost model's price stands for them."""
    import onnx

    chosen = {c["conv"]: c["algorithm"] for c in choices if isinstance(c, dict) and "conv" in c}
    if not chosen:
        return {}
    threads = json.loads(next(iter(chosen)))[-1]
    cache = _read_cache(cache_file)
    g = onnx.shape_inference.infer_shapes(program).graph
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*g.input, *g.value_info)}
    weights = {t.name: list(t.dims) for t in g.initializer}
    out: dict[str, float] = {}
    for node in g.node:
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in weights or not node.name:
            continue
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        x, w = dims.get(node.input[0]), weights[node.input[1]]
        if not x or len(x) != 4 or len(w) != 4 or int(a.get("group", 1)) != 1:
            continue
        key = json.dumps([[x[0], x[2], x[3], x[1]], [w[2], w[3], w[1], w[0]], list(a.get("strides", [1, 1])),
                          list(a.get("dilations", [1, 1])), list(a.get("pads", [0, 0, 0, 0])), threads])
        entry, algorithm = cache.get(key), chosen.get(key)
        seconds = entry.get("seconds", {}).get(algorithm) if isinstance(entry, dict) and algorithm else None
        if isinstance(seconds, (int, float)) and seconds > 0:
            out[node.name] = float(seconds)
    return out


def _walk(mod: Any, on_conv: Any) -> Any:
    """Visit every ``relax.nn.conv2d`` call of ``mod`` (weights resolved through their bindings);
    ``on_conv(builder, call, weight, params)`` returns what replaces the call (the call itself to
    keep it). Returns the mutated module."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    conv_op = tvm.ir.Op.get("relax.nn.conv2d")

    @mutator
    class _Convs(PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.module = module

        def transform(self):
            for gv, func in self.module.functions_items():
                if isinstance(func, relax.Function):
                    self.builder_.update_func(gv, self.visit_expr(func))
            return self.builder_.get()

        def visit_call_(self, call):  # noqa: N802 - TVM's method name
            call = self.builder_.normalize(super().visit_call_(call))
            if not isinstance(call, relax.Call) or not call.op.same_as(conv_op):
                return call
            weight = call.args[1]
            if isinstance(weight, relax.Var):
                weight = self.lookup_binding(weight)
            return on_conv(self.builder_, call, weight, _conv_params(call, weight))

    return _Convs(mod).transform()


def choose_algorithms(mod: Any, algorithm: str, target: Any, cache_file: Path | None = None,
                      record: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """The choice step (rule 2): ``{conv key: algorithm}`` for every eligible conv of ``mod`` that
    does not stay direct. ``"auto"`` measures (:func:`measure`, cached); a fixed algorithm is
    taken where the conv is eligible for it. Nothing in ``mod`` changes. ``record``, when given,
    receives one ``{"conv", "algorithm", "from"}`` per distinct eligible conv ("auto" only)."""
    if algorithm not in ALGORITHMS:
        raise BackendError(f"unknown conv algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    sites: dict[str, dict[str, Any]] = {}
    if algorithm != "direct":
        def collect(_bb: Any, call: Any, _weight: Any, p: dict[str, Any] | None) -> Any:
            if p is not None:
                sites.setdefault(_key(p), p)
            return call

        _walk(mod, collect)
    choices: dict[str, str] = {}
    for key, p in sites.items():
        if algorithm == "auto":
            chosen, source = measure(p, target, cache_file)
            if record is not None:
                record.append({"conv": key, "algorithm": chosen, "from": source})
        else:
            chosen = algorithm if p.get(algorithm) else "direct"
        if chosen != "direct":
            choices[key] = chosen
    return choices


def apply_algorithms(mod: Any, choices: dict[str, str]) -> tuple[Any, dict[str, int]]:
    """The rewrite step (rule 1): each conv named in ``choices`` becomes its algorithm's TE stages;
    returns the module and a count of the algorithm used per conv (``direct`` included)."""
    from tvm import relax

    counts: dict[str, int] = {}

    def rewrite(bb: Any, call: Any, weight: Any, p: dict[str, Any] | None) -> Any:
        chosen = choices.get(_key(p), "direct") if p is not None else "direct"
        counts[chosen] = counts.get(chosen, 0) + 1
        return call if chosen == "direct" else _emit(bb, chosen, call.args[0], weight, p)

    if not choices:
        return mod, {}
    mod = _walk(mod, rewrite)
    return relax.transform.Normalize()(relax.transform.DeadCodeElimination()(mod)), counts


def _has_conv(mod: Any) -> bool:
    """Whether any Relax function of ``mod`` calls ``relax.nn.conv2d`` (a C++ walk: cheap, so the
    default ``auto`` costs a conv-free model nothing)."""
    import tvm
    from tvm import relax

    conv_op, found = tvm.ir.Op.get("relax.nn.conv2d"), []

    def visit(e: Any) -> None:
        if not found and isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.same_as(conv_op):
            found.append(e)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function) and not found:
            relax.analysis.post_order_visit(func, visit)
    return bool(found)


def rewrite_convolutions(mod: Any, algorithm: str, target: Any, cache_file: Path | None = None,
                         record: list[dict[str, Any]] | None = None) -> tuple[Any, dict[str, int]]:
    """Choose (:func:`choose_algorithms`), then rewrite (:func:`apply_algorithms`) every eligible
    ``relax.nn.conv2d`` of ``mod``; returns the module and a count of the algorithm used per conv.
    When no conv is rewritten the module comes back as it was given (rule 2)."""
    from tvm import relax

    from .fold_small_constants import fold_small_constants_pass

    if algorithm == "direct" or not _has_conv(mod):
        return mod, {}
    with target:  # weights' layout transposes in numpy first: FoldConstant compiles one kernel each
        folded = relax.transform.FoldConstant()(fold_small_constants_pass()(mod))
    choices = choose_algorithms(folded, algorithm, target, cache_file, record)
    if not choices:  # every conv stays direct: counted, module unchanged
        counts: dict[str, int] = {}

        def count(_bb: Any, call: Any, _w: Any, _p: Any) -> Any:
            counts["direct"] = counts.get("direct", 0) + 1
            return call

        _walk(folded, count)
        return mod, counts
    return apply_algorithms(folded, choices)


#: ConvTranspose with kernel == stride becomes a GEMM + pixel shuffle (:func:`conv_transpose_as_matmul`)
CONV_TRANSPOSE_AS_MATMUL = True


def conv_transpose_as_matmul(func: Any) -> Any:
    """Rewrite each non-overlapping transposed convolution of a Relax function as one GEMM.

    Shapes it is for: ``relax.nn.conv2d_transpose`` with a constant weight, NCHW data / IOHW
    weight / NCHW output (TVM 0.27's ConvertLayout has no NHWC rule for it), static shapes,
    stride equal to the kernel size (U-Net's 2x2 stride-2 upsampling), no padding, no output
    padding, dilation 1, one group. There each input pixel writes its own ``kh x kw`` block of
    the output: ``y[n, o, i*kh + a, j*kw + b] = sum_c x[n, c, i, j] * W[c, o, a, b]``, i.e. the
    GEMM ``[N*H*W, C] x [C, kh*kw*O]`` (a weight packed at build time by GemmPacked) followed by
    a pixel shuffle. TOPI's ``conv2d_transpose_nchw`` instead dilates the input with zeros (for
    stride 2: 4x the data, 3/4 zeros), pads it, and runs a ``kh x kw`` convolution over it: 4x
    the FLOPs, two materialised copies, and an NCHW loop nest. Measured (held-out U-Net at
    64 px, batch 8, 1 thread, thread CPU time): the two 2x2 ConvTranspose kernels took 4.8 ms
    of 25.7 ms. Other transposed convolutions (overlapping windows, padding) are left alone."""
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    if not CONV_TRANSPOSE_AS_MATMUL:
        return func
    x, w = wildcard(), is_const()
    pat = is_op("relax.nn.conv2d_transpose")(x, w)

    def rewrite(expr: Any, m: Any) -> Any:
        p = _conv_transpose_params(expr, m[w])
        if p is None:
            return expr
        n, c, h, wd, kh, kw, o = p
        weight = m[w].value.numpy()  # [C, O, kh, kw]
        w2 = np.ascontiguousarray(weight.transpose(0, 2, 3, 1).reshape(c, kh * kw * o))
        op = relax.op
        rows = op.reshape(op.permute_dims(m[x], [0, 2, 3, 1]), [n * h * wd, c])
        y = op.reshape(op.matmul(rows, relax.const(w2)), [n, h, wd, kh, kw, o])
        y = op.reshape(op.permute_dims(y, [0, 1, 3, 2, 4, 5]), [n, h * kh, wd * kw, o])
        return op.permute_dims(y, [0, 3, 1, 2])

    return rewrite_call(pat, rewrite, func)


def _conv_transpose_params(call: Any, weight: Any) -> tuple[int, ...] | None:
    """(N, C, H, W, kh, kw, O) when ``call`` is a transposed conv :func:`conv_transpose_as_matmul`
    rewrites; None otherwise."""
    a = call.attrs
    try:
        n, c, h, wd = (int(d) for d in call.args[0].ty.shape.values)
        ci, o, kh, kw = (int(d) for d in weight.value.shape)
    except (TypeError, ValueError, AttributeError):
        return None
    layouts = (str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout))
    if layouts != ("NCHW", "IOHW", "NCHW") or int(a.groups) != 1 or ci != c:
        return None
    if [int(s) for s in a.strides] != [kh, kw] or any(int(d) != 1 for d in a.dilation):
        return None
    if any(int(v) for v in a.padding) or any(int(v) for v in a.output_padding):
        return None
    if str(weight.value.dtype) != "float32" or (a.out_dtype is not None and str(a.out_dtype) not in ("", "float32", "void")):
        return None
    return n, c, h, wd, kh, kw, o
