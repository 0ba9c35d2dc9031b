"""``partitioner train MODEL --data train.npz``: train a model from its ONNX graph.

Builds the training step (forward + loss + backward + optimizer, standard ONNX ops), runs it on
one rank or data-parallel ranks with the state resident between steps, shows a progress bar
(step, loss, samples/s) and writes ``-o DIR``: ``history.json`` (the loss curve), a checkpoint
per epoch (``checkpoint_epoch<k>.onnx``, the model with trained weights, which ``partitioner
compile`` deploys; the optimizer state beside it) and ``model.onnx`` (the latest). See
docs/training.md.
"""

from __future__ import annotations

import argparse

from partitioner.commands._options import add_json_argument, print_json

NAME = "train"
HELP = "train a model from its ONNX graph (autodiff, SGD/momentum/Adam, data-parallel ranks)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="an .onnx file, or a zoo name")
    p.add_argument("--data", required=True, help=".npz with x (inputs) and y (labels)")
    p.add_argument("--loss", default="cross_entropy", choices=("cross_entropy", "mse"))
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "momentum", "adam", "adamw"))
    p.add_argument("--lr", type=float, default=0.01, help="learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=32, help="global batch (split over --devices)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--devices", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--strategy", default="data",
                   help="data (default), auto (the cost model's fastest plan), pipeline (one stage per device), tensor (Megatron MLP "
                        "pairs), hybrid (data x pipeline) or single")
    p.add_argument("--stages", type=int, default=None,
                   help="hybrid: pipeline stages per data-parallel replica (default 2; --devices a multiple)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"), help="pipeline schedule")
    p.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="pipeline micro-batches per step (default 2 x --devices; must divide --batch)")
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "tvm"))
    p.add_argument("--launcher", default="threads", choices=("threads", "mpi"),
                   help="data-parallel ranks as threads of this process (default) or processes under mpiexec")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0, help="shuffling seed")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT",
                   help="start from a checkpoint_epoch<k>.onnx of this model (and its .state.npz), any --devices")
    p.add_argument("-o", "--output", default="run", metavar="DIR", help="run folder (checkpoints, history.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--memory-limit", default=None, metavar="BYTES",
                   help="per-device memory limit, e.g. 2GiB: auto picks a plan whose predicted peak fits; "
                        "a given strategy that does not fit is refused")
    p.add_argument("--plan", action="store_true",
                   help="print the predicted step time, samples/s and peak memory per rank, and exit (no training)")
    p.add_argument("--bench", action="store_true",
                   help="train, then report predicted against measured step time and peak memory per rank "
                        "(several devices run as MPI processes)")
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    from partitioner.training.loop import train

    if args.plan:
        return _plan(args)
    if args.bench:
        return _bench(args)
    result = train(args.model, args.data, loss=args.loss, optimizer=args.optimizer, lr=args.lr,
                   weight_decay=args.weight_decay, batch=args.batch, epochs=args.epochs, devices=args.devices,
                   strategy=args.strategy, backend=args.backend, out_dir=args.output, seed=args.seed,
                   progress=not (args.no_progress or args.json), launcher=args.launcher, resume=args.resume,
                   threads=args.threads, schedule=args.schedule, micro_batches=args.micro_batches,
                   stages=args.stages, memory_limit=_limit(args))
    h = result.history
    report = {"steps": len(h), "first_loss": h[0]["loss"] if h else None, "last_loss": h[-1]["loss"] if h else None,
              "checkpoints": result.checkpoints, "output": args.output}
    if args.json:
        print_json(report)
    else:
        print(f"trained {len(h)} steps: loss {report['first_loss']:.4f} -> {report['last_loss']:.4f}; "
              f"checkpoint {result.checkpoints[-1] if result.checkpoints else '-'}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """``--plan``: the training cost model's prediction (partitioner/cost/training.py)."""
    from partitioner.training.plan import predict_training

    strategy = "single" if args.devices == 1 else args.strategy
    if strategy == "auto":
        from partitioner.training.plan import choose_strategy

        strategy = choose_strategy(args.model, args.devices, batch=args.batch, optimizer=args.optimizer,
                                   micro_batches=args.micro_batches, memory_limit=_limit(args))[0]
    p = predict_training(args.model, strategy, args.devices, batch=args.batch, optimizer=args.optimizer,
                         schedule=args.schedule, micro_batches=args.micro_batches, stages=args.stages,
                         memory_limit=_limit(args))
    if args.json:
        print_json(p.to_json())
        return 0
    sched = f" {p.schedule}, {p.micro_batches} micro-batches" if p.schedule else ""
    sched += ", recompute" if p.recompute else ""
    print(f"{strategy} on {p.devices} device(s){sched}, batch {p.batch}: predicted step {p.step_time_s * 1e3:.3f} ms, "
          f"{p.samples_per_s:.1f} samples/s")
    for r, m in enumerate(p.memory_per_rank):
        print(f"  rank {r}: peak memory {m / 2**20:.1f} MiB (weights, gradients, optimizer state, stashed activations)")
    print("  " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in p.breakdown.items()))
    return 0


def _bench(args: argparse.Namespace) -> int:
    """``--bench``: predicted against measured (partitioner/training/bench.py)."""
    from partitioner.training.bench import bench_training, format_report

    doc = bench_training(args.model, args.data, devices=args.devices, strategy=args.strategy, batch=args.batch,
                         optimizer=args.optimizer, schedule=args.schedule, micro_batches=args.micro_batches,
                         stages=args.stages, memory_limit=_limit(args), out_dir=args.output, loss=args.loss,
                         lr=args.lr, weight_decay=args.weight_decay, epochs=args.epochs, backend=args.backend,
                         seed=args.seed, threads=args.threads, progress=False)
    print_json(doc) if args.json else print(format_report(doc))
    return 0


def _limit(args: argparse.Namespace) -> float | None:
    from partitioner.commands._options import parse_bytes

    return float(parse_bytes(args.memory_limit)) if args.memory_limit else None
