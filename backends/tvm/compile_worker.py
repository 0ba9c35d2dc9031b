"""Child process that compiles one rank: ``python -m backends.tvm.compile_worker PROGRAM OUT TARGET OPTIONS``.

:func:`backends.tvm.build.build_all` starts one per distinct program. A fresh interpreter (not
``multiprocessing``) is used because spawn/forkserver re-run the caller's ``__main__`` script
(a user script without a ``__main__`` guard would recurse) and TVM is not fork-safe; plain files
and JSON lines also keep pickle out of the build.

Protocol on stdout, one line each: ``stage <name>`` as it progresses, then ``facts <json>`` on
success, or ``error <message>`` (exit 2) for a project error. Anything else is a crash (exit 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx


def main(argv: list[str]) -> int:
    program_path, out_path, target_json, options_json = argv
    from partitioner.core.errors import PartitionerError

    from .build import build_one

    def report(stage: str) -> None:
        print(f"stage {stage}", flush=True)

    try:
        program = onnx.load(program_path, load_external_data=False)  # external weights: parameters
        facts = build_one(program, Path(out_path), json.loads(target_json), json.loads(options_json), report)
    except PartitionerError as e:
        print(f"error {str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        return 2
    print(f"facts {json.dumps(facts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
