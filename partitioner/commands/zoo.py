"""``partitioner zoo list|export``: list the model zoo, or write one zoo model to an .onnx file.

``zoo list [--json]`` prints a table of name, kind and description (``--json``: the entries
with their default arguments). ``zoo export NAME -o FILE [--batch N ...]`` builds the model
with only the options the user gave (the others stay at the model's defaults) and saves it.
"""

from __future__ import annotations

import argparse
import os

from partitioner.commands._options import add_json_argument, print_json
from partitioner.core.errors import UsageError

NAME = "zoo"
HELP = "list the model zoo, or export a zoo model to an .onnx file"

#: (option, builder argument, type, help) for ``zoo export``; each defaults to None (= not given).
_EXPORT_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("--batch", "batch", int, "batch size"),
    ("--layers", "layers", int, "number of layers (mlp, bert, gpt)"),
    ("--hidden", "hidden", int, "hidden width (mlp, bert, gpt)"),
    ("--seq", "seq", int, "sequence length (bert, gpt)"),
    ("--heads", "heads", int, "attention heads (bert, gpt)"),
    ("--vocab", "vocab", int, "vocabulary size (bert, gpt)"),
    ("--image", "image", int, "image height and width (CNNs)"),
    ("--depth", "depth", int, "ResNet depth: 18, 34, 50, 101 or 152"),
    ("--width", "width", int, "ResNet base channels"),
    ("--width-mult", "width_mult", float, "MobileNet width multiplier"),
    ("--classes", "classes", int, "number of classes (classifiers)"),
    ("--seed", "seed", int, "weight seed"),
    ("--weights", "weights", str, "light models: random (seeded, the default) or as_shipped (onnx's 0.02 constants)"),
    ("--size", "size", str, "llama: tiny, 7b or 70b"),
    ("--intermediate", "intermediate", int, "llama: MLP width"),
    ("--kv-heads", "kv_heads", int, "llama: key/value heads (grouped-query attention)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="zoo_command", metavar="ACTION")
    p_list = sub.add_parser("list", help="list the zoo models", description="List the zoo models.")
    add_json_argument(p_list)
    p_exp = sub.add_parser("export", help="write a zoo model to an .onnx file",
                           description="Build a zoo model and save it as an .onnx file.")
    p_exp.add_argument("name", metavar="NAME", help="a zoo model name (see `partitioner zoo list`)")
    p_exp.add_argument("-o", "--output", required=True, metavar="FILE", help="the .onnx file to write")
    for option, dest, kind, text in _EXPORT_OPTIONS:
        p_exp.add_argument(option, dest=dest, type=kind, default=None, help=text)
    p_exp.add_argument("--symbolic-batch", dest="symbolic_batch", action="store_const", const=True,
                       default=None, help="make the batch dimension symbolic (gpt)")
    p_exp.add_argument("--shapes-only", dest="shapes_only", action="store_const", const=True, default=None,
                       help="llama: no weights; the model references a sparse data file beside it, for "
                            "planning (docs/large_models.md)")
    add_json_argument(p_exp)


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "zoo_command", None)
    if action == "list":
        return _list(args)
    if action == "export":
        return _export(args)
    raise UsageError("zoo: give an action, `partitioner zoo list` or `partitioner zoo export NAME -o FILE`")


def _list(args: argparse.Namespace) -> int:
    from models_zoo import list_models

    entries = list_models()
    if args.json:
        print_json([{"name": e.name, "kind": e.kind, "description": e.description, "params": e.params}
                    for e in entries])
        return 0
    wn = max(len("NAME"), *(len(e.name) for e in entries))
    wk = max(len("KIND"), *(len(e.kind) for e in entries))
    print(f"{'NAME':<{wn}}  {'KIND':<{wk}}  DESCRIPTION")
    for e in entries:
        print(f"{e.name:<{wn}}  {e.kind:<{wk}}  {e.description}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from models_zoo import build
    from models_zoo.export_large import data_file_name, save_model

    names = [dest for _, dest, _, _ in _EXPORT_OPTIONS] + ["symbolic_batch", "shapes_only"]
    kwargs = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise UsageError(f"{args.output}: the folder {folder} does not exist; create it first")
    extra = {"data_location": data_file_name(args.output)} if kwargs.get("shapes_only") else {}
    model = build(args.name, **kwargs, **extra)
    written = save_model(model, args.output)
    size = written["bytes"]
    params = sum(_numel(t) for t in model.graph.initializer)
    report = {"name": args.name, "path": args.output, "arguments": kwargs, "nodes": len(model.graph.node),
              "parameters": params, "bytes": size, "data_file": written["data_file"],
              "data_bytes": written["data_bytes"], "sparse": written["sparse"]}
    if args.json:
        print_json(report)
    else:
        given = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        data = (f" + {written['data_bytes'] / 1e9:.2f} GB {'sparse ' if written['sparse'] else ''}external data in "
                f"{written['data_file']}" if written["data_file"] else "")
        print(f"wrote {args.name}{f' ({given})' if given else ''} to {args.output}: "
              f"{len(model.graph.node)} nodes, {params:,} parameters, {size / 1e6:.1f} MB{data}")
    return 0


def _numel(tensor: object) -> int:
    n = 1
    for d in tensor.dims:  # type: ignore[attr-defined]
        n *= int(d)
    return n
