"""``inspect --train``: the backward pass of a contraction-dominated model costs about twice its
forward (each product's two operand gradients are one product each; the first layer needs no
input gradient, so a little under 2x), and every node of the step is in exactly one part."""

from __future__ import annotations

import json

import models_zoo
from partitioner.cli import main
from partitioner.training import build_training_graph, step_program
from partitioner.training.analysis import training_stats


def test_backward_is_about_twice_the_forward_and_parts_cover_the_step(capsys) -> None:
    model = models_zoo.build("mlp", batch=4)
    stats = training_stats(model)
    ratio = stats["backward_over_forward"]["flops"]
    assert 1.5 <= ratio <= 2.5, ratio
    nodes = len(step_program(build_training_graph(model)).graph.node)
    assert sum(stats[p]["nodes"] for p in ("forward", "loss", "backward", "optimizer")) == nodes
    assert main(["inspect", "mlp", "--batch", "4", "--train", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["train"]["backward"]["flops"] > report["train"]["forward"]["flops"]


def test_batchnorm_rewrite_counts_as_forward_and_backward_nodes_name_their_forward_node() -> None:
    model = models_zoo.build("resnet", batch=2, image=32, width=4, classes=10)
    step = build_training_graph(model)
    forward_names = {n.name for n in step.graph if "training.forward_node" not in n.metadata_props}
    tagged = [n for n in step.graph if n.metadata_props.get("training.forward_node") not in (None, "loss", "optimizer")]
    assert tagged and all(n.metadata_props["training.forward_node"] in forward_names
                          or n.metadata_props["training.forward_node"] in {m.metadata_props.get("training.rewrite_of")
                                                                            for m in step.graph} for n in tagged)
    stats = training_stats(model)
    assert 1.5 <= stats["backward_over_forward"]["flops"] <= 2.5
