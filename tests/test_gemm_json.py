"""store.gemm_json: M buckets, shape/default files, and the lookup order shape -> default -> None."""

import json
import math
import warnings

import pytest

from tritune import knobs
from tritune.store import gemm_json as gj
from tritune.store.atomic import json_safe
from tritune.store.gemm_json import GemmConfigStore, GemmEntry
from tritune.tuning.types import Config

PROV = {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "triton_version": "3.9", "torch_version": "2.13"}
SLUG = "NVIDIA_H100_80GB_HBM3"


def cfg(bm: int, bn: int = 128, warps: int = 4) -> Config:
    return Config.of(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_warps=warps, num_stages=3)


def entry(M: int, config: Config, time_us: float = 10.0) -> GemmEntry:
    return GemmEntry(M=M, config=config, time_us=time_us, tflops=100.0, gbps=900.0, error=0.0)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(knobs.CONFIG_DIR, str(tmp_path))
    # The package ships real H100 files: keep them out of these lookups.
    shipped = tmp_path / "shipped-empty"
    shipped.mkdir()
    monkeypatch.setattr(gj, "PACKAGE_DIR", shipped)
    return tmp_path


@pytest.mark.parametrize("M, bucket", [
    (1, "small"), (31, "small"),  # lowest M; last of small
    (32, "medium_M32"),  # the one-value bucket
    (33, "medium_M64"), (64, "medium_M64"),
    (65, "medium_M128"), (128, "medium_M128"),
    (129, "large"), (256, "large"),
    (257, "xlarge"), (1 << 20, "xlarge"),
])
def test_m_bucket(M, bucket):
    assert gj.m_bucket(M) == bucket


def test_m_bucket_rejects_empty():
    with pytest.raises(ValueError, match="M must be >= 1"):
        gj.m_bucket(0)
    assert gj.BUCKETS[-1] == "any" and len(gj.BUCKETS) == 7


def test_names_and_slug():
    assert gj.slug_of(PROV["name"]) == SLUG
    assert gj.shape_file_name(SLUG, "A8W8_BLOCKSCALE", 7168, 512) == f"{SLUG}-GEMM-A8W8_BLOCKSCALE-N=7168-K=512.json"
    assert gj.default_file_name(SLUG, "BF16") == f"{SLUG}-GEMM-BF16.json"


def test_entry_round_trip_with_nan_error():
    e = GemmEntry(M=16, config=cfg(16), time_us=3.5, tflops=1.0, gbps=2.0, error=math.nan)
    d = json.loads(json.dumps(json_safe(e.to_dict())))  # as it lands on disk
    assert d["config"]["BLOCK_M"] == 16 and d["error"] is None
    back = GemmEntry.from_dict(d)
    assert back.config == e.config and back.M == 16 and math.isnan(back.error)
    with pytest.raises(ValueError, match="lacks gbps"):
        GemmEntry.from_dict({k: v for k, v in d.items() if k != "gbps"})


def test_entry_op_times_round_trip_and_old_entries_load():
    e = GemmEntry(M=16, config=cfg(16), time_us=16.5, tflops=1.0, gbps=2.0, error=0.0, eager_us=101.0,
                  graph_us=math.nan)  # eager measured; the graph could not be captured
    d = json.loads(json.dumps(json_safe(e.to_dict())))
    assert (d["time_us"], d["eager_us"], d["graph_us"]) == (16.5, 101.0, None)
    back = GemmEntry.from_dict(d)
    assert back.eager_us == 101.0 and math.isnan(back.graph_us) and back.time_us == 16.5
    old = {k: v for k, v in d.items() if k not in ("eager_us", "graph_us")}  # written before the fields existed
    back = GemmEntry.from_dict(old)
    assert back.time_us == 16.5 and math.isnan(back.eager_us) and math.isnan(back.graph_us)
    with pytest.raises(ValueError, match="eager_us='fast' is not a number"):
        GemmEntry.from_dict({**d, "eager_us": "fast"})


def test_old_shape_file_merges_with_op_times(tmp_path):
    path = gj.write_shape_file(tmp_path, PROV, "BF16", 64, 64, {16: entry(16, cfg(16))})
    doc = json.loads(path.read_text())
    for rec in [*doc["by_M"].values(), *doc["configs"].values()]:  # as an older tritune wrote it
        del rec["eager_us"], rec["graph_us"]
    path.write_text(json.dumps(doc))
    new = GemmEntry(M=32, config=cfg(32), time_us=5.0, tflops=1.0, gbps=1.0, error=0.0, eager_us=9.0, graph_us=5.5)
    gj.write_shape_file(tmp_path, PROV, "BF16", 64, 64, {32: new})
    doc = gj.read_gemm_file(path)
    assert (doc["by_M"]["16"]["eager_us"], doc["by_M"]["16"]["graph_us"]) == (None, None)  # not measured: null
    assert (doc["by_M"]["32"]["eager_us"], doc["by_M"]["32"]["graph_us"]) == (9.0, 5.5)
    assert doc["configs"]["medium_M32"]["eager_us"] == 9.0


def test_shape_file_buckets_and_merge(tmp_path):
    path = gj.write_shape_file(tmp_path, PROV, "BF16", 4096, 1024,
                               {16: entry(16, cfg(16)), 8: entry(8, cfg(8)), 64: entry(64, cfg(64)),
                                300: entry(300, cfg(256))})
    assert path.name == f"{SLUG}-GEMM-BF16-N=4096-K=1024.json"
    doc = gj.read_gemm_file(path)
    assert (doc["kernel"], doc["N"], doc["K"], doc["provenance"]) == ("BF16", 4096, 1024, PROV)
    assert list(doc["by_M"]) == ["8", "16", "64", "300"]
    buckets = {b: e["M"] for b, e in doc["configs"].items()}
    assert buckets == {"small": 16, "medium_M64": 64, "xlarge": 300, "any": 300}  # largest M per bucket

    # A second run tunes more M and re-tunes M=16: new M added, M=16 replaced, the others kept.
    gj.write_shape_file(tmp_path, PROV, "BF16", 4096, 1024, {16: entry(16, cfg(32)), 1000: entry(1000, cfg(128))})
    doc = gj.read_gemm_file(path)
    assert list(doc["by_M"]) == ["8", "16", "64", "300", "1000"]
    assert doc["by_M"]["16"]["config"]["BLOCK_M"] == 32
    assert doc["configs"]["xlarge"]["M"] == 1000 and doc["configs"]["any"]["M"] == 1000
    assert doc["configs"]["small"]["config"]["BLOCK_M"] == 32


def test_shape_file_rejects_mismatched_keys(tmp_path):
    with pytest.raises(ValueError, match="different M"):
        gj.write_shape_file(tmp_path, PROV, "BF16", 8, 8, {16: entry(32, cfg(16))})


def test_default_file_votes(tmp_path):
    a, b, c = cfg(16), cfg(32), cfg(64)
    # small: a wins 2 votes to 1. xlarge: b and c tie on votes (1 each, from 2 shapes); c is faster.
    gj.write_shape_file(tmp_path, PROV, "BF16", 1024, 1024, {8: entry(8, a), 512: entry(512, b, time_us=50.0)})
    gj.write_shape_file(tmp_path, PROV, "BF16", 2048, 1024, {8: entry(8, a), 512: entry(512, c, time_us=40.0)})
    gj.write_shape_file(tmp_path, PROV, "BF16", 4096, 1024, {8: entry(8, b)})
    # Other tags and devices in the same folder do not vote.
    gj.write_shape_file(tmp_path, PROV, "A8W8", 1024, 1024, {8: entry(8, c)})
    gj.write_shape_file(tmp_path, {**PROV, "name": "NVIDIA H200"}, "BF16", 1024, 1024, {8: entry(8, c)})

    path = gj.write_default_file(tmp_path, PROV, "BF16")
    assert path.name == f"{SLUG}-GEMM-BF16.json"
    doc = gj.read_gemm_file(path)
    assert doc["from_shapes"] == [{"N": 1024, "K": 1024}, {"N": 2048, "K": 1024}, {"N": 4096, "K": 1024}]
    small, xlarge, any_ = doc["configs"]["small"], doc["configs"]["xlarge"], doc["configs"]["any"]
    assert Config.from_dict(small["config"]) == a and (small["votes"], small["shapes"]) == (2, 3)
    assert Config.from_dict(xlarge["config"]) == c and (xlarge["votes"], xlarge["shapes"]) == (1, 2)
    # "any": b (shape 1: M=512, shape 3: M=8) has 2 votes, c 1.
    assert Config.from_dict(any_["config"]) == b and any_["votes"] == 2
    assert "medium_M64" not in doc["configs"]


def test_default_file_tie_breaks_on_config_key(tmp_path):
    a, b = cfg(16), cfg(32)
    gj.write_shape_file(tmp_path, PROV, "BF16", 1, 1, {8: entry(8, b)})
    gj.write_shape_file(tmp_path, PROV, "BF16", 2, 2, {8: entry(8, a)})
    doc = gj.read_gemm_file(gj.write_default_file(tmp_path, PROV, "BF16", device_slug=SLUG))
    assert Config.from_dict(doc["configs"]["small"]["config"]) == min(a, b, key=Config.key)


def test_default_file_needs_shapes(tmp_path):
    with pytest.raises(ValueError, match="no .*shape files"):
        gj.write_default_file(tmp_path, PROV, "BF16")


def test_lookup_order_shape_default_none(user_dir):
    shape_cfgs = {16: cfg(16), 64: cfg(64), 512: cfg(256)}
    gj.write_shape_file(user_dir, PROV, "BF16", 4096, 1024, {M: entry(M, c) for M, c in shape_cfgs.items()})
    gj.write_shape_file(user_dir, PROV, "BF16", 8192, 1024, {100: entry(100, cfg(128, warps=8))})
    gj.write_default_file(user_dir, PROV, "BF16")
    store = GemmConfigStore()
    shape = user_dir / f"{SLUG}-GEMM-BF16-N=4096-K=1024.json"
    default = user_dir / f"{SLUG}-GEMM-BF16.json"

    assert store.lookup(SLUG, "BF16", 64, 4096, 1024) == (cfg(64), f"shape file {shape} M=64")
    assert store.lookup(SLUG, "BF16", 40, 4096, 1024) == (cfg(64), f"shape file {shape} bucket medium_M64")
    # M=100 is in medium_M128, which this shape file lacks: its "any" (largest M) answers.
    assert store.lookup(SLUG, "BF16", 100, 4096, 1024) == (cfg(256), f"shape file {shape} bucket any")
    # No shape file for N=1: device default, by bucket, then "any".
    assert store.lookup(SLUG, "BF16", 100, 1, 1024) == (cfg(128, warps=8), f"device default {default} "
                                                                             "bucket medium_M128")
    assert store.lookup(SLUG, "BF16", 2, 1, 1024)[1] == f"device default {default} bucket small"
    got = store.lookup(SLUG, "BF16", 33, 1, 1024)  # medium_M64: one vote from 4096x1024
    assert got == (cfg(64), f"device default {default} bucket medium_M64")
    # Nothing for another tag or device.
    assert store.lookup(SLUG, "A8W8", 16, 4096, 1024) is None
    assert store.lookup("NVIDIA_H200", "BF16", 16, 4096, 1024) is None


def test_user_dir_wins_over_package_dir(tmp_path, monkeypatch):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    gj.write_shape_file(user, PROV, "BF16", 8, 8, {16: entry(16, cfg(16))})
    gj.write_shape_file(shipped, PROV, "BF16", 8, 8, {16: entry(16, cfg(32))})
    monkeypatch.setenv(knobs.CONFIG_DIR, str(user))
    monkeypatch.setattr(gj, "PACKAGE_DIR", shipped)
    store = GemmConfigStore()
    assert store.folders() == [user, shipped]
    assert store.lookup(SLUG, "BF16", 16, 8, 8)[0] == cfg(16)
    assert GemmConfigStore([shipped]).lookup(SLUG, "BF16", 16, 8, 8)[0] == cfg(32)


def test_cache_and_reload(user_dir):
    store = GemmConfigStore()
    assert store.lookup(SLUG, "BF16", 16, 8, 8) is None
    gj.write_shape_file(user_dir, PROV, "BF16", 8, 8, {16: entry(16, cfg(16))})
    assert store.lookup(SLUG, "BF16", 16, 8, 8) is None  # cached
    assert store.lookup(SLUG, "BF16", 17, 8, 8) is None  # absent file is cached too, not re-probed
    store.reload()
    assert store.lookup(SLUG, "BF16", 16, 8, 8)[0] == cfg(16)
    gj.write_shape_file(user_dir, PROV, "BF16", 8, 8, {16: entry(16, cfg(32))})
    assert store.lookup(SLUG, "BF16", 16, 8, 8)[0] == cfg(16)
    store.reload()
    assert store.lookup(SLUG, "BF16", 16, 8, 8)[0] == cfg(32)


def test_default_store_singleton(user_dir):
    gj.write_shape_file(user_dir, PROV, "BF16", 8, 8, {16: entry(16, cfg(16))})
    gj.reload_configs()  # picks up the monkeypatched TRITUNE_CONFIG_DIR
    assert gj.default_store() is gj.default_store()
    assert gj.default_store().lookup(SLUG, "BF16", 16, 8, 8)[0] == cfg(16)
    gj.reload_configs()


@pytest.mark.parametrize("content, fault", [
    ("{not json", "not valid JSON"),
    ("[]", "top level is not an object"),
    ('{"provenance": {}, "kernel": "BF16", "configs": {}, "N": 8, "K": 8, "by_M": {}}', "by_M"),
    ('{"provenance": {}, "kernel": "BF16", "configs": {"huge": {}}, "N": 8, "K": 8, "by_M": {}}', "unknown bucket"),
    ('{"provenance": {}, "kernel": "BF16", "N": 8, "K": 9, "by_M": {"16": {"M": 16, "config": {}, "time_us": 1,'
     '"tflops": 1, "gbps": 1, "error": 0}}, "configs": {"any": {"M": 16, "config": {}, "time_us": 1,'
     '"tflops": 1, "gbps": 1, "error": 0}}}', "do not match the file name"),
])
def test_malformed_file_raises_on_read(tmp_path, content, fault):
    path = tmp_path / f"{SLUG}-GEMM-BF16-N=8-K=8.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=fault) as info:
        gj.read_gemm_file(path)
    assert str(path) in str(info.value)


def test_malformed_user_file_warns_and_falls_back(tmp_path, monkeypatch):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    (user / f"{SLUG}-GEMM-BF16-N=8-K=8.json").write_text("{broken")
    gj.write_shape_file(shipped, PROV, "BF16", 8, 8, {16: entry(16, cfg(32))})
    monkeypatch.setenv(knobs.CONFIG_DIR, str(user))
    monkeypatch.setattr(gj, "PACKAGE_DIR", shipped)
    store = GemmConfigStore()
    with pytest.warns(UserWarning, match=r"malformed.*N=8-K=8\.json"):
        assert store.lookup(SLUG, "BF16", 16, 8, 8)[0] == cfg(32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.lookup(SLUG, "BF16", 20, 8, 8)[0] == cfg(32)  # once only: the bad file is remembered
    with pytest.raises(ValueError):  # a tuner writing over it is told, not allowed to clobber it
        gj.write_shape_file(user, PROV, "BF16", 8, 8, {16: entry(16, cfg(16))})


def test_missing_config_dir_warns_not_raises(tmp_path, monkeypatch):
    monkeypatch.setenv(knobs.CONFIG_DIR, str(tmp_path / "nope"))
    monkeypatch.setattr(gj, "PACKAGE_DIR", tmp_path)
    with pytest.warns(UserWarning, match="TRITUNE_CONFIG_DIR"):
        assert GemmConfigStore().lookup(SLUG, "BF16", 16, 8, 8) is None



def test_malformed_default_file_raises_on_read(tmp_path):
    path = tmp_path / f"{SLUG}-GEMM-BF16.json"
    path.write_text('{"provenance": {}, "kernel": "BF16", "configs": {"any": {"votes": 1}}}')
    with pytest.raises(ValueError, match=r"BF16\.json: config None is not an object"):
        gj.read_gemm_file(path)
    path.write_text('{"provenance": {}, "kernel": "A8W8", "configs": {"any": {"config": {}}}}')
    with pytest.raises(ValueError, match="does not match the file name"):
        gj.read_gemm_file(path)
