"""``make train-demo``: a small CNN trained from its ONNX graph on scikit-learn's digits.

load_digits ships inside the scikit-learn wheel (8x8 images, 10 classes, 1,797 samples; no
download). 20% is held out (stratified, seeded). The CNN is trained with `partitioner train` on
2 data-parallel ranks (Adam), then the last checkpoint is compiled with `partitioner compile`
(TVM, 1 device) and its predictions on the held-out set are checked against the ONNX Runtime
run of the same checkpoint. Prints the held-out accuracy; exits 1 under 95% or on a mismatch.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build_cnn(seed: int = 0) -> onnx.ModelProto:
    """conv3x3(16)-relu-maxpool2 -> conv3x3(32)-relu-maxpool2 -> flatten -> gemm(64)-relu -> gemm(10)."""
    rng = np.random.default_rng(seed)

    def he(*shape):
        fan_in = int(np.prod(shape[1:]))
        return numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2 / fan_in)).astype(np.float32))

    inits = []
    for name, arr in (("c1.w", he(16, 1, 3, 3)), ("c1.b", np.zeros(16, np.float32)), ("c2.w", he(32, 16, 3, 3)),
                      ("c2.b", np.zeros(32, np.float32)), ("f1.w", he(64, 128)), ("f1.b", np.zeros(64, np.float32)),
                      ("f2.w", he(10, 64)), ("f2.b", np.zeros(10, np.float32))):
        t = arr if isinstance(arr, onnx.TensorProto) else numpy_helper.from_array(arr)
        t.name = name
        inits.append(t)
    n = helper.make_node
    nodes = [n("Conv", ["x", "c1.w", "c1.b"], ["h1"], pads=[1, 1, 1, 1], name="conv1"), n("Relu", ["h1"], ["r1"], name="relu1"),
             n("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
             n("Conv", ["p1", "c2.w", "c2.b"], ["h2"], pads=[1, 1, 1, 1], name="conv2"), n("Relu", ["h2"], ["r2"], name="relu2"),
             n("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2], name="pool2"),
             n("Flatten", ["p2"], ["f"], axis=1, name="flatten"),
             n("Gemm", ["f", "f1.w", "f1.b"], ["g1"], transB=1, name="fc1"), n("Relu", ["g1"], ["r3"], name="relu3"),
             n("Gemm", ["r3", "f2.w", "f2.b"], ["logits"], transB=1, name="fc2")]
    g = helper.make_graph(nodes, "digits_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def main(out: str = "out/train_demo") -> int:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    t0 = time.time()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    xtr, xte, ytr, yte = train_test_split(x, digits.target.astype(np.int64), test_size=0.2, random_state=0,
                                          stratify=digits.target)
    np.savez(folder / "train.npz", x=xtr, y=ytr)
    onnx.save(build_cnn(), str(folder / "cnn.onnx"))
    cli = str(Path(sys.executable).with_name("partitioner"))
    subprocess.run([cli, "train", str(folder / "cnn.onnx"), "--data", str(folder / "train.npz"), "--loss", "cross_entropy",
                    "--optimizer", "adam", "--lr", "3e-3", "--batch", "32", "--epochs", "12", "--devices", "2",
                    "--strategy", "data", "-o", str(folder / "run")], check=True)
    ckpt = folder / "run" / "model.onnx"

    import onnxruntime as ort

    sess = ort.InferenceSession(str(ckpt), providers=["CPUExecutionProvider"])
    ort_pred = sess.run(None, {"x": xte})[0].argmax(axis=1)
    accuracy = float((ort_pred == yte).mean())

    # deploy: the checkpoint is a plain ONNX model; compile it for the held-out batch with TVM
    art = folder / "deployed"
    subprocess.run([cli, "compile", str(ckpt), "-o", str(art), "--devices", "1", "--batch", str(len(xte))], check=True)
    np.savez(folder / "heldout.npz", x=xte)
    subprocess.run([cli, "run", str(art), "--inputs", str(folder / "heldout.npz"), "--outputs",
                    str(folder / "pred.npz")], check=True)
    tvm_pred = np.load(folder / "pred.npz")["logits"].argmax(axis=1)
    same = bool(np.array_equal(tvm_pred, ort_pred))
    print(f"held-out accuracy {accuracy * 100:.1f}% on {len(yte)} digits (ONNX Runtime on the checkpoint); "
          f"compiled checkpoint (TVM) predictions {'identical' if same else 'DIFFERENT'}; {time.time() - t0:.0f} s")
    return 0 if accuracy >= 0.95 and same else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
