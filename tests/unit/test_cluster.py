import pytest

from partitioner.config.cluster import DEVICE_PRESETS, GIB, ClusterSpec, DeviceSpec, LinkSpec


def test_presets_cover_the_named_kinds():
    assert {"a100-40gb", "a100-80gb", "h100", "h200", "cpu"} <= set(DEVICE_PRESETS)
    assert DEVICE_PRESETS["cpu"].memory_bytes == 16 * GIB
    assert DEVICE_PRESETS["cpu"].flops_per_s == 50e9
    assert DEVICE_PRESETS["h100"].flops_per_s > DEVICE_PRESETS["a100-80gb"].flops_per_s


def test_homogeneous_cpu_is_one_node_and_gpus_fill_nodes_of_eight():
    cpu = ClusterSpec.homogeneous(4)
    assert cpu.num_devices == 4 and {d.node for d in cpu.devices} == {0} and cpu.is_homogeneous
    gpus = ClusterSpec.homogeneous(16, "h100")
    assert [d.node for d in gpus.devices] == [0] * 8 + [1] * 8
    assert gpus.link_between(0, 7) == gpus.intra_node_link
    assert gpus.link_between(7, 8) == gpus.inter_node_link
    a100 = ClusterSpec.homogeneous(2, "a100")
    assert a100.devices[0].kind == "a100-80gb" and a100.devices[0].memory_bytes == 80 * GIB


def test_heterogeneous_toml_with_overrides_and_links(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(
        """
[[group]]
kind = "h100"
count = 4
node = 0
[[group]]
kind = "a100-40gb"
count = 4
node = 1
memory_gib = 32
[links.intra_node]
bandwidth_bytes_per_s = 1e11
latency_s = 1e-6
[links.inter_node]
bandwidth_gbytes_per_s = 12.5
latency_s = 2e-5
"""
    )
    cluster = ClusterSpec.from_toml(path)
    assert [d.kind for d in cluster.devices] == ["h100"] * 4 + ["a100-40gb"] * 4
    assert cluster.devices[4].memory_bytes == 32 * GIB and cluster.devices[4].node == 1
    assert cluster.inter_node_link == LinkSpec(12.5e9, 2e-5)
    assert not cluster.is_homogeneous
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster


def test_round_trip_keeps_custom_names_and_spilled_nodes():
    cluster = ClusterSpec.from_dict({"group": [{"kind": "h200", "count": 3, "devices_per_node": 2,
                                                "names": ["x", "y", "z"]}]})
    assert [d.node for d in cluster.devices] == [0, 0, 1]
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster
    assert ClusterSpec.from_dict(ClusterSpec.homogeneous(12, "h100").to_dict()) == ClusterSpec.homogeneous(12, "h100")


def test_unknown_kind_lists_known_kinds():
    with pytest.raises(ValueError, match="known kinds: .*a100-40gb.*h100.*h200"):
        ClusterSpec.homogeneous(2, "tpu-v5")
    with pytest.raises(ValueError, match="unknown device kind 'mi300'"):
        ClusterSpec.from_dict({"group": [{"kind": "mi300", "count": 2}]})


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: DeviceSpec("d", "cpu", 0, 1e9, 0), "memory_bytes=0"),
        (lambda: DeviceSpec("d", "cpu", 10, -1.0, 0), "flops_per_s=-1.0"),
        (lambda: DeviceSpec("d", "cpu", 10, 1e9, -2), "node=-2"),
        (lambda: LinkSpec(0.0, 1e-6), "bandwidth_bytes_per_s=0.0"),
        (lambda: LinkSpec(1e9, -1.0), "latency_s=-1.0"),
        (lambda: ClusterSpec((), LinkSpec(1e9, 0), LinkSpec(1e9, 0)), "devices=()"),
        (lambda: ClusterSpec.homogeneous(0), "num_devices=0"),
        (lambda: ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 0}]}), "count=0"),
        (lambda: ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 1, "colour": 1}]}), "unknown keys"),
    ],
)
def test_validation_names_the_field_and_value(make, field):
    with pytest.raises(ValueError) as info:
        make()
    assert field in str(info.value)


def test_duplicate_device_names_are_rejected():
    device = DeviceSpec("same", "cpu", 10, 1e9, 0)
    with pytest.raises(ValueError, match="duplicate names"):
        ClusterSpec((device, device), LinkSpec(1e9, 0), LinkSpec(1e9, 0))
