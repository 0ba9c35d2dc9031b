"""Test-wide settings: no test depends on what this machine has cached.

The ``cpu:N`` preset reads this machine's calibration cache (partitioner/calibrate_cache.py), and
``plan``/``compile`` calibrate on first use. Tests point the cache at an empty temporary folder
and turn the first-use calibration off, so every test plans with the nominal figures unless it
writes a calibration itself. Set here, at import, so subprocesses (the CLI, mpiexec) inherit it."""

from __future__ import annotations

import os
import tempfile

os.environ["PARTITIONER_CACHE_DIR"] = tempfile.mkdtemp(prefix="partitioner-test-cache-")
os.environ["PARTITIONER_AUTO_CALIBRATE"] = "0"
# TVM builds compute convs directly unless a test asks for another algorithm: the build default,
# "auto", would time every distinct conv of every test model (backends/tvm/conv_algorithms.py);
# setdefault, so `PARTITIONER_CONV_ALGORITHM=auto pytest ...` runs the suite with the real default
os.environ.setdefault("PARTITIONER_CONV_ALGORITHM", "direct")
