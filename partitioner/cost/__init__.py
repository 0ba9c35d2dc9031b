"""Analytical cost model (COST_MODEL.md).

Modules, one concept each:

- :mod:`partitioner.cost.ops` — per-operator FLOPs, bytes and depth (:class:`OpCost`).
- :mod:`partitioner.cost.workdepth` — whole-graph work W, depth D, parameters, peak activations.
- :mod:`partitioner.cost.roofline` — time of one operator on one device.
- :mod:`partitioner.cost.comm` — alpha-beta collective formulas and algorithm choice.
- :mod:`partitioner.cost.pipeline` — GPipe bubble and fill-drain step time.
- :mod:`partitioner.cost.memory` — per-device memory estimate; the per-rank peak rule of each
  runtime (``rank_peak``).
- :mod:`partitioner.cost.threads` — threads per rank when a plan has fewer ranks than cores, and
  their speed-up per op class.
- :mod:`partitioner.cost.runtime_overhead` — the runtime's fixed costs per kernel, program run,
  comm op and step (shared by the simulator, the search estimate and training predictions).
- :mod:`partitioner.cost.simulate` — event simulator over per-rank programs with comm ops.
"""

from __future__ import annotations

from partitioner.cost.ops import OpCost, op_cost

__all__ = ["OpCost", "op_cost"]
