"""Lowering: plan + model -> per-rank onnx-ir programs with comm ops (partitioner.lowering.lower); they are checked by the one verifier, passes.verify.verify_programs."""
