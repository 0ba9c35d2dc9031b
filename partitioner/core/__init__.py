"""The ground floor: errors, comm op definitions, plan, bindings, segments, the model view and the
op-class table. Every other room may import it; it imports nothing of ours from above it
(tests/test_layering.py keeps that true)."""
