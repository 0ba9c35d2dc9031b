"""Run a TVM build on a thread with a large stack.

Rules:

1. :func:`run` calls ``fn(*args)`` on a new thread created with a stack of :data:`STACK_BYTES`
   and returns its result, or raises its exception, in the calling thread.
2. The process-wide default stack size for new threads is restored before :func:`run` returns.

Why: TVM's C++ passes recurse along the dataflow of a function. SLANet with its 501-step decoder
unrolled (31.5k ONNX nodes) died with SIGSEGV (exit 139) in the zero pipeline's ``FuseOps`` on
the main thread's 8 MiB stack; the same build under ``ulimit -s unlimited`` finished, and at 200
steps it fit. The main thread's stack is fixed when the process starts, so the build runs on a
thread made with a stack large enough for such graphs. The stack is reserved address space,
touched only as deep as the recursion goes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

STACK_BYTES = 1 << 30  # 1 GiB: 128x the default; FuseOps at 31.5k nodes needed more than 8 MiB


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Rules 1-2."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it was raised
            box["error"] = e

    old = threading.stack_size()
    threading.stack_size(STACK_BYTES)
    try:
        worker = threading.Thread(target=target, name="tvm-build", daemon=True)
        worker.start()
    finally:
        threading.stack_size(old)
    worker.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


__all__ = ["STACK_BYTES", "run"]
