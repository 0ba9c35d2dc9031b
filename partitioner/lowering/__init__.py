"""Lowering: plan + model -> per-rank programs with comm ops (partitioner.lowering.lower), and the one verifier of its output (partitioner.lowering.verify)."""
