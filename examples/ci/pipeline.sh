#!/usr/bin/env bash
# CI pipeline: compile + sign -> verify the signature -> run --check, keeping the artifact directory.
# Any mismatch (a tampered file, a wrong key, a wrong output) fails the pipeline.
#
#   examples/ci/pipeline.sh [MODEL] [ARTIFACT_DIR] [extra compile options...]
#   MODEL defaults to the zoo MLP (exported to the artifact's parent directory).
#   BACKEND=onnxruntime examples/ci/pipeline.sh   # skip the TVM build
#
# Signing, the way a release pipeline does it: the private key comes from the environment (a CI
# secret), the public key is what deployers trust.
#   PARTITIONER_SIGN_KEY   the EC private key, PEM text (e.g. a masked CI secret variable)
#   SIGN_PUBLIC_KEY        the published public key (PEM file) to verify with; default: derived
# Without PARTITIONER_SIGN_KEY a throwaway key is generated with openssl for this run only (said
# on stderr): the pipeline still proves that sign -> verify -> run works end to end.
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

KEYS=$(mktemp -d)
trap 'rm -rf "$KEYS"' EXIT
chmod 700 "$KEYS"
if [ -n "${PARTITIONER_SIGN_KEY:-}" ]; then
  (umask 077; printf '%s\n' "$PARTITIONER_SIGN_KEY" > "$KEYS/sign.pem")
else
  echo "pipeline: PARTITIONER_SIGN_KEY is not set: signing with a throwaway key generated for this run" >&2
  (umask 077; openssl ecparam -name prime256v1 -genkey -noout -out "$KEYS/sign.pem")
fi
PUB=${SIGN_PUBLIC_KEY:-$KEYS/pub.pem}
[ -n "${SIGN_PUBLIC_KEY:-}" ] || openssl ec -in "$KEYS/sign.pem" -pubout -out "$PUB" 2>/dev/null

"$CLI" compile "$MODEL" -o "$OUT" --devices 2 --strategy "${STRATEGY:-auto}" --backend "$BACKEND" \
  --fallback onnxruntime --sign-key "$KEYS/sign.pem" "$@"
rm -f "$KEYS/sign.pem"  # the private key is needed for signing only
"$CLI" verify "$OUT" --trusted-key "$PUB"

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

"$CLI" run "$OUT" --inputs "$OUT.inputs.npz" --outputs "$OUT.outputs.npz" --check --timeout 600 --trusted-key "$PUB"
echo "ok: $OUT signed, its signature verified with $PUB, and its outputs checked against ONNX Runtime"
