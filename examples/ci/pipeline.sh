#!/usr/bin/env bash
# CI pipeline: compile -> verify -> run --check, keeping the artifact directory.
# Any mismatch (a tampered file, a wrong output) fails the pipeline.
#
#   examples/ci/pipeline.sh [MODEL] [ARTIFACT_DIR] [extra compile options...]
#   MODEL defaults to the zoo MLP (exported to the artifact's parent directory).
#   BACKEND=onnxruntime examples/ci/pipeline.sh   # skip the TVM build
set -euo pipefail
cd "$(dirname "$0")/../.."
CLI=${CLI:-.venv/bin/partitioner}
PY=${PY:-.venv/bin/python}
BACKEND=${BACKEND:-tvm}
OUT=${2:-build/ci-artifact}
mkdir -p "$(dirname "$OUT")"
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL="$(dirname "$OUT")/mlp.onnx"
  "$CLI" zoo export mlp -o "$MODEL" --batch 4
fi
shift $(( $# > 2 ? 2 : $# ))

"$CLI" compile "$MODEL" -o "$OUT" --devices 2 --strategy "${STRATEGY:-auto}" --backend "$BACKEND" \
  --fallback onnxruntime "$@"
"$CLI" verify "$OUT"

# seeded inputs matching the artifact's bindings
"$PY" - "$OUT" <<'PY'
import json, sys
import numpy as np
out = sys.argv[1]
m = json.load(open(f"{out}/manifest.json"))
rng = np.random.default_rng(0)
feeds = {}
for b in m["bindings"]["inputs"]:
    dt = np.dtype(b["dtype"])
    feeds[b["name"]] = (rng.standard_normal(b["shape"]).astype(dt) if dt.kind == "f"
                        else rng.integers(0, 2, size=b["shape"]).astype(dt))
np.savez(f"{out}.inputs.npz", **feeds)
PY

"$CLI" run "$OUT" --inputs "$OUT.inputs.npz" --outputs "$OUT.outputs.npz" --check --timeout 600
echo "ok: $OUT verified and checked against ONNX Runtime"
