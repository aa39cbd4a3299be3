"""store.gemm_json: M buckets, shape/default files in aiter's layout (and the nested one of older tritune), output
dtypes in file names, and the lookup order shape -> default -> None."""

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

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
    # bf16 output (the default) keeps the names shipped files have; another output dtype is part of the tag.
    assert gj.shape_file_name(SLUG, "BF16", 8, 16, "bf16") == f"{SLUG}-GEMM-BF16-N=8-K=16.json"
    assert gj.shape_file_name(SLUG, "A8W8", 8, 16, "fp16") == f"{SLUG}-GEMM-A8W8-OUT_FP16-N=8-K=16.json"
    assert gj.default_file_name(SLUG, "BF16", "fp16") == f"{SLUG}-GEMM-BF16-OUT_FP16.json"
    assert gj.name_parts(f"{SLUG}-GEMM-A8W8-OUT_FP16-N=8-K=16.json") == (SLUG, "A8W8-OUT_FP16", True)
    with pytest.raises(ValueError, match="not a dtype name"):
        gj.file_tag("BF16", "FP16-N=1")


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


def nested_shape_doc(prov: dict, tag: str, N: int, K: int, entries: dict[int, GemmEntry]) -> dict:
    """A shape file as tritune wrote it before the aiter layout (format 1): whole entries under configs.bucket."""
    buckets = {gj.m_bucket(M): e for M, e in sorted(entries.items())}
    buckets["any"] = entries[max(entries)]
    return json_safe({"provenance": prov, "kernel": tag, "N": N, "K": K,
                      "by_M": {str(M): e.to_dict() for M, e in sorted(entries.items())},
                      "configs": {b: e.to_dict() for b, e in buckets.items()}})


def nested_default_doc(prov: dict, tag: str, configs: dict[str, Config]) -> dict:
    """A device default file of format 1: {"configs": {bucket: {"config", "votes", "shapes"}}}."""
    return {"provenance": prov, "kernel": tag, "from_shapes": [{"N": 8, "K": 8}],
            "configs": {b: {"config": c.as_dict(), "votes": 1, "shapes": 1} for b, c in configs.items()}}


def aiter_style_config(doc: dict, M: int) -> dict:
    """What a reader of aiter's GEMM files serves for M: the bucket's dict straight from the top level."""
    if M < 32 and "small" in doc:
        return doc["small"]
    if M <= 128:
        bucket = f"medium_M{max(32, 1 << (M - 1).bit_length())}"
        if bucket in doc:
            return doc[bucket]
    elif M <= 256 and "large" in doc:
        return doc["large"]
    elif M > 256 and "xlarge" in doc:
        return doc["xlarge"]
    return doc["any"]


def test_shape_file_is_in_the_aiter_layout(tmp_path):
    e16 = GemmEntry(M=16, config=cfg(16), time_us=3.0, tflops=1.0, gbps=2.0, error=0.0, eager_us=4.0, graph_us=3.5)
    path = gj.write_shape_file(tmp_path, PROV, "BF16", 64, 64, {16: e16, 100: entry(100, cfg(64))})
    doc = json.loads(path.read_text())
    assert list(doc) == ["small", "medium_M128", "any", "tritune"]  # buckets in order, then tritune's own key
    for bucket in ("small", "medium_M128", "any"):  # plain config dicts, nothing else inside
        assert set(doc[bucket]) == set(cfg(16).as_dict())
    assert aiter_style_config(doc, 16) == cfg(16).as_dict() and aiter_style_config(doc, 100) == cfg(64).as_dict()
    assert aiter_style_config(doc, 5000) == cfg(64).as_dict()  # no xlarge: "any" (the largest tuned M)
    meta = doc["tritune"]
    assert (meta["format"], meta["kernel"], meta["out_dtype"], meta["N"], meta["K"]) == (2, "BF16", "bf16", 64, 64)
    assert meta["provenance"] == PROV
    assert meta["by_M"]["16"] == {"M": 16, "config": cfg(16).as_dict(), "time_us": 3.0, "tflops": 1.0, "gbps": 2.0,
                                  "error": 0.0, "eager_us": 4.0, "graph_us": 3.5}
    parsed = gj.load_gemm_file(path)
    assert (parsed.layout, parsed.shape, parsed.by_M[16], parsed.configs["medium_M128"]) == ("aiter", (64, 64), e16,
                                                                                             cfg(64))


def test_default_file_is_in_the_aiter_layout(tmp_path):
    gj.write_shape_file(tmp_path, PROV, "BF16", 64, 64, {16: entry(16, cfg(16)), 300: entry(300, cfg(128))})
    doc = json.loads(gj.write_default_file(tmp_path, PROV, "BF16").read_text())
    assert list(doc) == ["small", "xlarge", "any", "tritune"]
    assert doc["small"] == cfg(16).as_dict() and doc["any"] == cfg(128).as_dict()
    meta = doc["tritune"]
    assert meta["from_shapes"] == [{"N": 64, "K": 64}] and meta["provenance"] == PROV and meta["out_dtype"] == "bf16"
    assert meta["votes"] == {b: {"votes": 1, "shapes": 1} for b in ("small", "xlarge", "any")}


def test_nested_layout_files_still_serve(user_dir):
    """Files an older tritune wrote into TRITUNE_CONFIG_DIR keep working: read, looked up, voted, merged."""
    shape = user_dir / gj.shape_file_name(SLUG, "BF16", 64, 64)
    shape.write_text(json.dumps(nested_shape_doc(PROV, "BF16", 64, 64, {16: entry(16, cfg(16)),
                                                                       64: entry(64, cfg(64))})))
    default = user_dir / gj.default_file_name(SLUG, "BF16")
    default.write_text(json.dumps(nested_default_doc(PROV, "BF16", {"large": cfg(128), "any": cfg(256)})))
    parsed = gj.load_gemm_file(shape)
    assert (parsed.layout, parsed.kernel, parsed.out_dtype, sorted(parsed.by_M)) == ("nested", "BF16", "bf16", [16, 64])
    assert gj.load_gemm_file(default).configs == {"large": cfg(128), "any": cfg(256)}
    store = GemmConfigStore()
    assert store.lookup(SLUG, "BF16", 16, 64, 64) == (cfg(16), f"shape file {shape} M=16")
    assert store.lookup(SLUG, "BF16", 40, 64, 64) == (cfg(64), f"shape file {shape} bucket medium_M64")
    assert store.lookup(SLUG, "BF16", 200, 8, 8) == (cfg(128), f"device default {default} bucket large")
    assert store.shape_entries(SLUG, "BF16", 64, 64)[1][64] == entry(64, cfg(64))

    # Merging into it (a re-tune) rewrites it in the aiter layout, keeping the old entries.
    new = GemmEntry(M=32, config=cfg(32), time_us=5.0, tflops=1.0, gbps=1.0, error=0.0, eager_us=9.0, graph_us=5.5)
    gj.write_shape_file(user_dir, PROV, "BF16", 64, 64, {32: new})
    doc = gj.read_gemm_file(shape)
    assert sorted(doc["tritune"]["by_M"], key=int) == ["16", "32", "64"] and "configs" not in doc
    assert (doc["small"], doc["medium_M32"], doc["any"]) == (cfg(16).as_dict(), cfg(32).as_dict(), cfg(64).as_dict())
    # The device default is voted from both layouts alike.
    old = user_dir / gj.shape_file_name(SLUG, "BF16", 128, 64)
    old.write_text(json.dumps(nested_shape_doc(PROV, "BF16", 128, 64, {16: entry(16, cfg(16))})))
    votes = gj.read_gemm_file(gj.write_default_file(user_dir, PROV, "BF16"))
    assert votes["small"] == cfg(16).as_dict() and votes["tritune"]["votes"]["small"] == {"votes": 2, "shapes": 2}


UPGRADE = Path(__file__).resolve().parent.parent / "scripts" / "upgrade_gemm_json.py"


def test_upgrade_script_rewrites_old_files_and_refuses_bad_paths_in_one_line(tmp_path):
    def upgrade(*args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(UPGRADE), *map(str, args)], capture_output=True, text=True,
                              timeout=120)

    path = tmp_path / gj.shape_file_name(SLUG, "BF16", 64, 64)
    path.write_text(json.dumps(nested_shape_doc(PROV, "BF16", 64, 64, {16: entry(16, cfg(16))})))
    done = upgrade(tmp_path)
    assert (done.returncode, done.stdout) == (0, f"upgraded: {path}\n")
    assert "tritune" in json.loads(path.read_text()) and upgrade(path).stdout == f"already new: {path}\n"
    # Once tracebacks: a missing path, a file that is not JSON, and no path at all (argparse's usage, exit 2).
    (tmp_path / "junk.json").write_text("not json")
    for args, expected in (((tmp_path / "missing",), f"{tmp_path / 'missing'}: no such file or folder"),
                           ((tmp_path / "junk.json",), f"{tmp_path / 'junk.json'}: not valid JSON (")):
        done = upgrade(*args)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and expected in done.stderr
    assert upgrade().returncode == 2 and upgrade("--help").returncode == 0


def test_old_entries_without_op_times_merge(tmp_path):
    path = tmp_path / gj.shape_file_name(SLUG, "BF16", 64, 64)
    doc = nested_shape_doc(PROV, "BF16", 64, 64, {16: entry(16, cfg(16))})
    for rec in [*doc["by_M"].values(), *doc["configs"].values()]:  # as a still older tritune wrote it
        del rec["eager_us"], rec["graph_us"]
    path.write_text(json.dumps(doc))
    new = GemmEntry(M=32, config=cfg(32), time_us=5.0, tflops=1.0, gbps=1.0, error=0.0, eager_us=9.0, graph_us=5.5)
    gj.write_shape_file(tmp_path, PROV, "BF16", 64, 64, {32: new})
    by_M = gj.read_gemm_file(path)["tritune"]["by_M"]
    assert (by_M["16"]["eager_us"], by_M["16"]["graph_us"]) == (None, None)  # not measured: null
    assert (by_M["32"]["eager_us"], by_M["32"]["graph_us"]) == (9.0, 5.5)


def test_to_aiter_layout_loses_nothing(tmp_path):
    entries = {1: entry(1, cfg(16), 2.0), 64: entry(64, cfg(64), 3.0), 4096: entry(4096, cfg(256), 90.0)}
    old = nested_shape_doc(PROV, "A8W8", 512, 256, entries)
    new = gj.to_aiter_layout(old, gj.shape_file_name(SLUG, "A8W8", 512, 256))
    assert new["tritune"] == {"format": 2, "kernel": "A8W8", "out_dtype": "bf16", "provenance": PROV, "N": 512,
                              "K": 256, "by_M": old["by_M"]}
    assert {b: new[b] for b in old["configs"]} == {b: rec["config"] for b, rec in old["configs"].items()}
    path = tmp_path / gj.shape_file_name(SLUG, "A8W8", 512, 256)
    path.write_text(json.dumps(new))
    assert gj.load_gemm_file(path).by_M == entries
    default = nested_default_doc(PROV, "A8W8", {"small": cfg(16), "any": cfg(32)})
    new = gj.to_aiter_layout(default)
    assert (new["small"], new["any"]) == (cfg(16).as_dict(), cfg(32).as_dict())
    assert new["tritune"]["votes"] == {"small": {"votes": 1, "shapes": 1}, "any": {"votes": 1, "shapes": 1}}
    assert new["tritune"]["from_shapes"] == default["from_shapes"]
    old["configs"]["small"]["config"] = cfg(32).as_dict()  # hand-edited: the new layout would lose it
    with pytest.raises(ValueError, match="not the by_M entry of M=1"):
        gj.to_aiter_layout(old)
    with pytest.raises(ValueError, match="not in the nested layout"):
        gj.to_aiter_layout(new)


def test_output_dtypes_never_share_files(user_dir):
    bf16 = gj.write_shape_file(user_dir, PROV, "BF16", 8, 8, {16: entry(16, cfg(16))})
    fp16 = gj.write_shape_file(user_dir, PROV, "BF16", 8, 8, {16: entry(16, cfg(32))}, out_dtype="fp16")
    assert (bf16.name, fp16.name) == (f"{SLUG}-GEMM-BF16-N=8-K=8.json", f"{SLUG}-GEMM-BF16-OUT_FP16-N=8-K=8.json")
    assert gj.read_gemm_file(fp16)["tritune"]["out_dtype"] == "fp16"
    default = gj.write_default_file(user_dir, PROV, "BF16", out_dtype="fp16")  # votes among fp16-out files only
    assert default.name == f"{SLUG}-GEMM-BF16-OUT_FP16.json"
    assert gj.read_gemm_file(default)["small"] == cfg(32).as_dict()
    assert gj.read_gemm_file(gj.write_default_file(user_dir, PROV, "BF16"))["small"] == cfg(16).as_dict()
    store = GemmConfigStore()
    assert store.lookup(SLUG, "BF16", 16, 8, 8)[0] == cfg(16)
    assert store.lookup(SLUG, "BF16", 16, 8, 8, out_dtype="fp16")[0] == cfg(32)
    assert store.shape_entries(SLUG, "BF16", 8, 8, out_dtype="fp16")[1][16].config == cfg(32)
    assert store.lookup(SLUG, "BF16", 16, 4, 4, out_dtype="fp16")[1].endswith("-OUT_FP16.json bucket small")
    # A file whose content says another output dtype than its name is malformed.
    doc = json.loads(fp16.read_text())
    bf16.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="out_dtype 'fp16'.*does not match the file name"):
        gj.read_gemm_file(bf16)


def test_shape_file_buckets_and_merge(tmp_path):
    path = gj.write_shape_file(tmp_path, PROV, "BF16", 4096, 1024,
                               {16: entry(16, cfg(16)), 8: entry(8, cfg(8)), 64: entry(64, cfg(64)),
                                300: entry(300, cfg(256))})
    assert path.name == f"{SLUG}-GEMM-BF16-N=4096-K=1024.json"
    doc = gj.read_gemm_file(path)
    meta = doc["tritune"]
    assert (meta["kernel"], meta["N"], meta["K"], meta["provenance"]) == ("BF16", 4096, 1024, PROV)
    assert list(meta["by_M"]) == ["8", "16", "64", "300"]
    buckets = {b: c["BLOCK_M"] for b, c in doc.items() if b != "tritune"}
    assert buckets == {"small": 16, "medium_M64": 64, "xlarge": 256, "any": 256}  # largest M per bucket (8 < 16)

    # A second run tunes more M and re-tunes M=16: new M added, M=16 replaced, the others kept.
    gj.write_shape_file(tmp_path, PROV, "BF16", 4096, 1024, {16: entry(16, cfg(32)), 1000: entry(1000, cfg(128))})
    doc = gj.read_gemm_file(path)
    assert list(doc["tritune"]["by_M"]) == ["8", "16", "64", "300", "1000"]
    assert doc["tritune"]["by_M"]["16"]["config"]["BLOCK_M"] == 32
    assert doc["xlarge"]["BLOCK_M"] == doc["any"]["BLOCK_M"] == 128  # M=1000 now
    assert doc["small"]["BLOCK_M"] == 32


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
    meta = doc["tritune"]
    assert meta["from_shapes"] == [{"N": 1024, "K": 1024}, {"N": 2048, "K": 1024}, {"N": 4096, "K": 1024}]
    votes = meta["votes"]
    assert Config.from_dict(doc["small"]) == a and votes["small"] == {"votes": 2, "shapes": 3}
    assert Config.from_dict(doc["xlarge"]) == c and votes["xlarge"] == {"votes": 1, "shapes": 2}
    # "any": b (shape 1: M=512, shape 3: M=8) has 2 votes, c 1.
    assert Config.from_dict(doc["any"]) == b and votes["any"]["votes"] == 2
    assert "medium_M64" not in doc and "medium_M64" not in votes


def test_default_file_tie_breaks_on_config_key(tmp_path):
    a, b = cfg(16), cfg(32)
    gj.write_shape_file(tmp_path, PROV, "BF16", 1, 1, {8: entry(8, b)})
    gj.write_shape_file(tmp_path, PROV, "BF16", 2, 2, {8: entry(8, a)})
    doc = gj.read_gemm_file(gj.write_default_file(tmp_path, PROV, "BF16", device_slug=SLUG))
    assert Config.from_dict(doc["small"]) == min(a, b, key=Config.key)


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


_ENTRY16 = '{"M": 16, "config": {}, "time_us": 1, "tflops": 1, "gbps": 1, "error": 0}'
_META = '"provenance": {}, "kernel": "BF16", "format": 2, "N": 8, "K": 8'


@pytest.mark.parametrize("content, fault", [
    ("{not json", "not valid JSON"),
    ("[]", "top level is not an object"),
    ('{"small": {"BLOCK_SIZE_M": 16}, "any": {"BLOCK_SIZE_M": 16}}', "neither a 'tritune' key"),  # aiter's own file
    ('{"any": {}, "tritune": []}', "'tritune' is not an object"),
    ('{"any": {}, "tritune": {"format": 3}}', "format' is 3; this tritune reads format 2"),
    ('{"any": {}, "tritune": {"format": 2, "kernel": "BF16", "N": 8, "K": 8, "by_M": {}}}', "'provenance' is missing"),
    ('{"any": {}, "M_LEQ_64": {}, "tritune": {' + _META + ', "by_M": {"16": ' + _ENTRY16 + '}}}',
     r"unknown bucket\(s\) \['M_LEQ_64'\]"),
    ('{"any": {"config": {"BLOCK_SIZE_M": 16}}, "tritune": {' + _META + ', "by_M": {"16": ' + _ENTRY16 + '}}}',
     "is not a scalar"),  # a nested record where a plain config belongs
    ('{"small": {}, "tritune": {' + _META + ', "by_M": {"16": ' + _ENTRY16 + '}}}', "no 'any' bucket"),
    ('{"any": {}, "tritune": {' + _META + ', "by_M": {}}}', "by_M"),
    ('{"any": {}, "tritune": {' + _META + ', "out_dtype": "fp16", "by_M": {"16": ' + _ENTRY16 + '}}}',
     "does not match the file name"),
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
