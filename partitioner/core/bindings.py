"""Input/output bindings: how a model's global tensors map onto per-rank program tensors.

Lowering produces them, the artifact manifest stores them, and every runtime uses the same
:func:`scatter_inputs` / :func:`gather_outputs`, so the split rules live in one place.

Rules:
1. With ``microbatches = M > 1`` the global batch (axis 0 of every input and output) is first cut
   into M equal micro-batches; per-rank programs are built for one micro-batch and each rank runs
   its program M times, in order.
2. Within one micro-batch, each :class:`Placement` says which slice ``[start, stop)`` along
   ``axis`` of the tensor a rank sees under its local name; ``axis = None`` means the whole tensor.
3. An output is assembled from its placements: slices are concatenated along their axis in
   ``start`` order; a whole-tensor placement is taken from its (first) rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from partitioner.core.errors import InputError, VerifyError


@dataclass(frozen=True)
class Placement:
    rank: int
    local_name: str
    axis: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class TensorBinding:
    name: str
    shape: tuple[int, ...]
    dtype: str
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class Bindings:
    inputs: tuple[TensorBinding, ...]
    outputs: tuple[TensorBinding, ...]
    world_size: int
    microbatches: int = 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Bindings:
        def tb(d: Mapping[str, Any]) -> TensorBinding:
            return TensorBinding(d["name"], tuple(d["shape"]), d["dtype"], tuple(Placement(**p) for p in d["placements"]))

        return cls(tuple(tb(d) for d in data["inputs"]), tuple(tb(d) for d in data["outputs"]),
                   int(data["world_size"]), int(data.get("microbatches", 1)))

    def check(self) -> None:
        """Every input reaches some rank and every output is fully covered."""
        for b in self.inputs + self.outputs:
            if not b.placements:
                raise VerifyError(f"binding of {b.name!r} has no placement")
            for p in b.placements:
                if not 0 <= p.rank < self.world_size:
                    raise VerifyError(f"binding of {b.name!r} names rank {p.rank} of {self.world_size}")
        if self.microbatches > 1:
            for b in self.inputs + self.outputs:
                if not b.shape or b.shape[0] % self.microbatches:
                    raise VerifyError(f"{b.name!r}: batch {b.shape[:1]} is not divisible by {self.microbatches} micro-batches")
        for b in self.outputs:
            sliced = sorted((p for p in b.placements if p.axis is not None), key=lambda p: p.start)
            if sliced and not any(p.axis is None for p in b.placements):
                size = self.microbatch_shape(b)[sliced[0].axis]
                ends = [0] + [p.stop for p in sliced]
                if any(p.start != e for p, e in zip(sliced, ends)) or sliced[-1].stop != size:
                    raise VerifyError(f"output {b.name!r}: slices do not cover axis {sliced[0].axis} of size {size}")

    def microbatch_shape(self, b: TensorBinding) -> tuple[int, ...]:
        if self.microbatches == 1:
            return tuple(b.shape)
        return (b.shape[0] // self.microbatches,) + tuple(b.shape[1:])


def check_inputs(bindings: Bindings, feeds: Mapping[str, np.ndarray]) -> None:
    """Refuse missing, unknown or mis-shaped inputs with a one-line message naming the input."""
    want = {b.name: b for b in bindings.inputs}
    missing = [n for n in want if n not in feeds]
    if missing:
        raise InputError(f"missing input(s): {', '.join(missing)} (the model needs {', '.join(want)})")
    unknown = [n for n in feeds if n not in want]
    if unknown:
        raise InputError(f"unknown input(s): {', '.join(unknown)} (the model needs {', '.join(want)})")
    for name, b in want.items():
        x = feeds[name]
        if tuple(x.shape) != tuple(b.shape):
            raise InputError(f"input {name!r}: shape {list(x.shape)} but the artifact was built for {list(b.shape)}")
        if np.dtype(x.dtype) != np.dtype(b.dtype):
            raise InputError(f"input {name!r}: dtype {x.dtype} but the artifact was built for {b.dtype}")


def scatter_inputs(bindings: Bindings, feeds: Mapping[str, np.ndarray]) -> list[list[dict[str, np.ndarray]]]:
    """Return ``per_rank[rank][microbatch] -> {local_name: array}``."""
    check_inputs(bindings, feeds)
    m = bindings.microbatches
    out: list[list[dict[str, np.ndarray]]] = [[{} for _ in range(m)] for _ in range(bindings.world_size)]
    for b in bindings.inputs:
        micro = np.split(feeds[b.name], m, axis=0) if m > 1 else [feeds[b.name]]
        for k, x in enumerate(micro):
            for p in b.placements:
                part = x if p.axis is None else np.take(x, range(p.start, p.stop), axis=p.axis)
                out[p.rank][k][p.local_name] = np.asarray(part, order="C")
    return out


def gather_outputs(bindings: Bindings, per_rank: Sequence[Sequence[Mapping[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """Inverse of :func:`scatter_inputs` for outputs: ``per_rank[rank][microbatch]`` -> global outputs."""
    result: dict[str, np.ndarray] = {}
    for b in bindings.outputs:
        micro = []
        for k in range(bindings.microbatches):
            whole = [p for p in b.placements if p.axis is None]
            if whole:
                micro.append(per_rank[whole[0].rank][k][whole[0].local_name])
                continue
            parts = sorted(b.placements, key=lambda p: p.start)
            micro.append(np.concatenate([per_rank[p.rank][k][p.local_name] for p in parts], axis=parts[0].axis))
        result[b.name] = micro[0] if len(micro) == 1 else np.concatenate(micro, axis=0)
    return result


def seeded_inputs(bindings: Bindings, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs of the bound shapes: floats ~ N(0, 1); integer inputs (token ids, indices) are
    0 or 1, valid for any embedding table or gather axis of size 2 or more."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for b in bindings.inputs:
        dt = np.dtype(b.dtype)
        if dt.kind == "f":
            feeds[b.name] = rng.standard_normal(b.shape).astype(dt)
        elif dt.kind == "b":
            feeds[b.name] = np.ones(b.shape, dtype=dt)
        else:
            feeds[b.name] = rng.integers(0, 2, size=b.shape).astype(dt)
    return feeds
