"""CLI sub-commands, one module each (see :mod:`partitioner.cli`)."""
