"""backends/tvm/executable.py rule 5: an output that shares bytes with a persistent input buffer is
copied. The check is a bisection over the input buffers' byte ranges; it must agree with
``np.may_share_memory`` on views of every kind (slices, reversed and strided views, reshapes,
whole buffers, and arrays outside every buffer)."""

from __future__ import annotations

import numpy as np

from backends.tvm.executable import TvmRankExecutable


def _executable_with_buffers(buffers: list[np.ndarray]) -> TvmRankExecutable:
    exe = object.__new__(TvmRankExecutable)  # only the buffers matter here: no library
    exe._in_bufs = [(None, b) for b in buffers] + [None]
    exe._spans = None
    return exe


def test_overlap_check_agrees_with_numpy() -> None:
    rng = np.random.default_rng(0)
    pool = np.zeros(4096, np.float32)  # buffers carved from one block: neighbours touch
    buffers = [pool[0:512], pool[512:1536].reshape(32, 32), pool[2048:2560]]
    exe = _executable_with_buffers(buffers)
    candidates = [pool[1536:2048], pool[2560:], np.zeros(16, np.float32), buffers[0], buffers[1].T,
                  buffers[1][::-1, ::3], buffers[2][::-2], pool[500:520], pool[1530:1540], pool[3000:3001],
                  buffers[1].reshape(-1)[1023:], np.zeros(0, np.float32)]
    for _ in range(200):
        a, b = sorted(rng.integers(0, 4096, 2))
        step = int(rng.integers(1, 4))
        candidates.append(pool[a:b + 1:step] if rng.random() < 0.5 else pool[b:a:-step])
    for arr in candidates:
        expected = any(np.may_share_memory(arr, buf) for buf in buffers) and arr.nbytes > 0
        assert exe._in_input_buffer(arr) == expected, (arr.shape, arr.strides)
