"""Cluster presets, JSON round trips, topology queries and one-line errors on bad input."""

from __future__ import annotations

import json

import pytest

from partitioner.cluster import Cluster, Device, LinkLevel, calibration_path
from partitioner.core.errors import ClusterError

PRESETS = ["cpu:1", "cpu:4", "h100x8", "h200x8", "h200:4x8", "a100:16x8", "edge"]


@pytest.mark.parametrize("spec", PRESETS)
def test_presets_load_and_round_trip(spec, tmp_path):
    c = Cluster.resolve(spec)
    assert Cluster.from_json(c.to_json()) == c
    path = tmp_path / "c.json"
    c.save(path)
    assert Cluster.resolve(str(path)) == c


def test_preset_sizes_and_published_numbers():
    h = Cluster.resolve("h200:4x8")
    assert h.size == 32 and len(h.nodes) == 4
    d = h.devices[0]
    assert d.peak("bfloat16") == 989e12 and d.peak("float32") == 67e12
    assert d.memory_bytes == 141e9 and d.memory_bandwidth == 4.8e12
    assert h.levels[0].bandwidth == pytest.approx(450e9)  # NVLink 4: 900 GB/s both ways
    assert h.levels[1].bandwidth == pytest.approx(50e9)  # 400 Gb/s
    a = Cluster.resolve("a100:16x8")
    assert a.size == 128 and a.devices[5].peak("float16") == 312e12
    assert Cluster.resolve("h100x8").devices[0].memory_bandwidth == 3.35e12
    e = Cluster.resolve("edge")
    assert e.size == 2 and e.link(0, 1).bandwidth == pytest.approx(125e6)  # 1 Gb/s
    assert Cluster.resolve("cpu:3").size == 3


def test_link_and_group_level():
    c = Cluster.resolve("h200:4x8")
    assert c.link(0, 7).name == "nvlink4"
    assert c.link(7, 8).name == "ib-ndr-400g"
    assert c.link(3, 3).alpha_s == 0
    assert c.group_level(range(8)).name == "nvlink4"
    assert c.group_level([0, 31]).name == "ib-ndr-400g"
    assert c.ranks_by_node([0, 1, 9, 17]) == [[0, 1], [9], [17]]
    with pytest.raises(ClusterError):
        c.link(0, 32)


def test_local_falls_back_to_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARTITIONER_CALIBRATION", str(tmp_path / "none.json"))
    c = Cluster.resolve("local")
    assert c.name.startswith("cpu:")
    assert "no calibration" in capsys.readouterr().err
    cal = Cluster("mine", (Device("c0", "cpu", {"float32": 1e10}, 1e9, 1e10, 1.0, 1e-6),), ((0,),),
                  (LinkLevel("shm", 1e-6, 1e-9),))
    cal.save(calibration_path())
    assert Cluster.resolve("local") == cal
    assert Cluster.resolve("local:3").size == 3


def test_count_expands_devices_and_nodes_default(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"name": "two", "devices": [
        {"name": "g", "kind": "gpu", "count": 2, "peak_flops": {"float32": 1e12},
         "memory_bytes": 1e9, "memory_bandwidth": 1e11}],
        "levels": [{"name": "pcie", "alpha_s": 1e-5, "beta_s_per_byte": 1e-10}]}))
    c = Cluster.load(p)
    assert [d.name for d in c.devices] == ["g0", "g1"] and c.nodes == ((0, 1),)
    assert c.devices[0].efficiency == 1.0


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    ("[]", "top level"),
    (json.dumps({"devices": [], "levels": []}), "'devices'"),
    (json.dumps({"devices": [{"peak_flops": {"float32": 1e9}, "memory_bytes": 1e9}],
                 "levels": [{"alpha_s": 0, "beta_s_per_byte": 0}]}), "'memory_bandwidth'"),
    (json.dumps({"devices": [{"peak_flops": {"float32": "fast"}, "memory_bytes": 1e9, "memory_bandwidth": 1}],
                 "levels": [{"alpha_s": 0, "beta_s_per_byte": 0}]}), "'float32'"),
    (json.dumps({"devices": [{"peak_flops": {"float32": 1e9}, "memory_bytes": 1e9, "memory_bandwidth": 1}],
                 "nodes": [[0, 1]], "levels": [{"alpha_s": 0, "beta_s_per_byte": 0}]}), "'nodes'"),
    (json.dumps({"devices": [{"peak_flops": {"float32": 1e9}, "memory_bytes": 1e9, "memory_bandwidth": 1}],
                 "levels": [{"alpha_s": 0}]}), "'beta_s_per_byte'"),
])
def test_bad_cluster_file(tmp_path, content, needle):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(ClusterError) as info:
        Cluster.resolve(str(p))
    msg = str(info.value)
    assert "bad.json" in msg and needle in msg and "\n" not in msg


def test_missing_file_and_unknown_preset():
    with pytest.raises(ClusterError, match="cannot read cluster file"):
        Cluster.resolve("/nonexistent/cluster.json")
    with pytest.raises(ClusterError) as info:
        Cluster.resolve("tpu-pod")
    msg = str(info.value)
    for name in ("cpu:N", "local", "h100x8", "h200:4x8", "a100:16x8", "edge"):
        assert name in msg
    assert "\n" not in msg
