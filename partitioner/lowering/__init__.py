"""Lowering: plan + model -> per-rank programs (see partitioner.lower)."""
