import os

from spswap.fsutil import atomic_write_json, read_json
from spswap.instance.registry import InstanceRecord, InstanceRegistry
from spswap.units import fmt_bytes, fmt_rate, fmt_seconds


def test_registry_put_list_remove(tmp_path):
    reg = InstanceRegistry(tmp_path / "instances")
    assert reg.list() == []
    reg.put(InstanceRecord(id="j1", model="m", state="up", pid=os.getpid(), uid=0))
    reg.put(InstanceRecord(id="j2", model="m", state="saved", pid=2**22 + 3, uid=0))
    listed = {r.id: alive for r, alive in reg.list()}
    assert listed == {"j1": True, "j2": False}
    reg.remove("j1")
    reg.remove("j1")  # twice is fine
    assert [r.id for r, _ in reg.list()] == ["j2"]


def test_atomic_json_roundtrip_leaves_no_temp_files(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"b": 1})
    assert read_json(tmp_path / "a.json") == {"b": 1}
    assert read_json(tmp_path / "missing.json", default=[]) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_units():
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(3 << 30) == "3.0 GiB"
    assert fmt_rate(55e9, 1.0) == "55.00 GB/s"
    assert fmt_seconds(0.0123) == "12.3 ms"
    assert fmt_seconds(2.5) == "2.50 s"
    assert fmt_seconds(5e-6) == "5 us"
