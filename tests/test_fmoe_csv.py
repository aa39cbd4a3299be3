"""store.fmoe_csv: written forms by table, one-line errors, atomic writes, merging, token buckets and lookup."""

import csv
import os
import warnings
from pathlib import Path

import pytest

from tritune import knobs
from tritune.kernels.fused_moe import MoeConfig
from tritune.store import fmoe_csv as fc
from tritune.store import fmoe_rows as fr
from tritune.store import fmoe_table as ft
from tritune.store.fmoe_rows import FmoeCsvError, FmoeShape, FmoeTuned
from tritune.store.fmoe_table import FmoeConfigTable

# DeepSeek-V3-like routed experts, fp8 blockwise: every column has a non-default value.
BASE = {"token": "16", "model_dim": "7168", "inter_dim": "256", "expert": "256", "topk": "8",
        "act_type": "ActivationType.Silu", "dtype": "dtypes.bf16", "q_dtype_a": "dtypes.fp8",
        "q_dtype_w": "dtypes.fp8", "q_type": "QuantType.per_1x128", "use_g1u1": "True", "doweight_stage1": "False"}
TUNED_BASE = {"cu_num": "132", **BASE, "block_m": "64", "ksplit": "1", "us1": "12.50", "kernelName1": "stage1_a",
              "err1": "0.5%", "us2": "7.25", "kernelName2": "stage2_b", "err2": "0%", "us": "19.75",
              "run_1stage": "False", "tflops": "101.50", "bw": "2345.60"}
SHAPE = FmoeShape(token=16, model_dim=7168, inter_dim=256, expert=256, topk=8, act_type="silu", dtype="bf16",
                  q_dtype_a="fp8", q_dtype_w="fp8", q_type="per_1x128", use_g1u1=True, doweight_stage1=False)


def write_rows(path: Path, rows: list[dict[str, str]], header: list[str] | None = None) -> Path:
    header = header if header is not None else list(rows[0])
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        writer.writerows([[row.get(name, "") for name in header] for row in rows])
    return path


def tuned(shape: FmoeShape = SHAPE, cu_num: int = 132, us: float = 19.75, **kw) -> FmoeTuned:
    fields = dict(block_m=64, ksplit=1, us1=12.5, kernelName1="stage1_a", err1=0.005, us2=7.25,
                  kernelName2="stage2_b", err2=0.0, us=us, run_1stage=False, tflops=101.5, bw=2345.6)
    return FmoeTuned(cu_num=cu_num, shape=shape, **{**fields, **kw})


def quant_none(written: str) -> dict[str, str]:
    """Overrides for an unquantised row whose dtype and both q dtypes are `written`."""
    return {"dtype": written, "q_dtype_a": written, "q_dtype_w": written, "q_type": "QuantType.No"}


ACCEPTED = [
    pytest.param({}, {}, id="canonical-qualified-forms"),
    pytest.param({"act_type": "ActivationType.Gelu"}, {"act_type": "gelu"}, id="act-qualified-gelu"),
    pytest.param({"act_type": "Silu"}, {"act_type": "silu"}, id="act-bare-Silu"),
    pytest.param({"act_type": "Gelu"}, {"act_type": "gelu"}, id="act-bare-Gelu"),
    pytest.param({"act_type": "silu"}, {"act_type": "silu"}, id="act-lower-silu"),
    pytest.param({"act_type": "gelu"}, {"act_type": "gelu"}, id="act-lower-gelu"),
    pytest.param({"act_type": "  ActivationType.Gelu "}, {"act_type": "gelu"}, id="act-surrounding-spaces-stripped"),
    *[pytest.param(quant_none(w), {"dtype": v, "q_dtype_a": v, "q_dtype_w": v}, id=f"dtype-{w}")
      for w, v in [("dtypes.bf16", "bf16"), ("dtypes.fp16", "fp16"), ("torch.bfloat16", "bf16"),
                   ("torch.float16", "fp16"), ("bf16", "bf16"), ("fp16", "fp16")]],
    *[pytest.param({"q_dtype_a": w, "q_dtype_w": w}, {"q_dtype_a": "fp8", "q_dtype_w": "fp8"}, id=f"qdtype-{w}")
      for w in ["dtypes.fp8", "torch.float8_e4m3fn", "torch.float8_e4m3fnuz", "fp8"]],
    pytest.param({"q_dtype_a": "torch.float8_e4m3fnuz", "q_dtype_w": "torch.float8_e4m3fn"},
                 {"q_dtype_a": "fp8", "q_dtype_w": "fp8"}, id="qdtype-amd-fnuz-mixed-with-fn-both-fp8"),
    pytest.param({**quant_none("dtypes.fp16"), "q_type": "No"}, {"q_type": "none"}, id="qtype-bare-No"),
    pytest.param(quant_none("dtypes.bf16"), {"q_type": "none"}, id="qtype-qualified-No"),
    pytest.param({"q_type": "QuantType.per_Token"}, {"q_type": "per_token"}, id="qtype-qualified-per_Token"),
    pytest.param({"q_type": "per_Token"}, {"q_type": "per_token"}, id="qtype-bare-per_Token"),
    pytest.param({"q_type": "per_1x128"}, {"q_type": "per_1x128"}, id="qtype-bare-per_1x128"),
    *[pytest.param({col: w}, {col: v}, id=f"{col}-{w}") for col in ("use_g1u1", "doweight_stage1")
      for w, v in [("True", True), ("False", False), ("true", True), ("false", False), ("1", True), ("0", False)]],
    pytest.param({"token": "1"}, {"token": 1}, id="token-smallest"),
    pytest.param({"token": " 32768 "}, {"token": 32768}, id="token-with-spaces"),
    pytest.param({"topk": "256"}, {"topk": 256}, id="topk-equals-expert"),
]


@pytest.mark.parametrize("overrides, expected", ACCEPTED)
def test_untuned_accepts_every_written_form(tmp_path, overrides, expected):
    path = write_rows(tmp_path / "untuned.csv", [{**BASE, **overrides}])
    [shape] = fc.read_untuned(path)
    for name, value in expected.items():
        assert getattr(shape, name) == value
    untouched = {f for f in BASE if f not in expected}
    assert all(getattr(shape, f) == getattr(SHAPE, f) for f in untouched - set(overrides))


@pytest.mark.parametrize("column, written, value", [
    ("err1", "0.5%", 0.005),  # percentage string, the canonical form
    ("err1", "0.005", 0.005),  # bare float is a fraction already
    ("err2", "0%", 0.0),  # zero error
    ("err2", "1e-3", 0.001),  # exponent notation
    ("run_1stage", "1", True), ("run_1stage", "true", True), ("run_1stage", "False", False),  # bool spellings
    ("ksplit", "0", 0),  # aiter writes 0 for "no split-K"
    ("us2", "0", 0.0),  # 1-stage winners have no stage-2 time
    ("kernelName2", "", ""),  # ... and no stage-2 kernel
])
def test_tuned_accepts_written_forms(tmp_path, column, written, value):
    path = write_rows(tmp_path / "tuned.csv", [{**TUNED_BASE, column: written}])
    [row] = fc.read_tuned(path)
    assert getattr(row, column) == value


BAD = [
    ("act_type", "ActivationType.Relu", "expected one of ActivationType.Silu, ActivationType.Gelu"),  # unknown act
    ("act_type", "SILU", "unknown value"),  # tables are case-sensitive
    ("dtype", "dtypes.fp8", "not allowed as dtype"),  # fp8 is only for q dtypes
    ("dtype", "torch.float32", "expected one of dtypes.bf16, dtypes.fp16"),  # unsupported dtype
    ("q_dtype_a", "dtypes.int8", "expected one of dtypes.bf16, dtypes.fp16, dtypes.fp8"),
    ("q_dtype_w", "", "empty value"),  # empty cell
    ("q_type", "QuantType.per_Tensor", "QuantType.per_1x128"),  # aiter's per-tensor is not supported
    ("dtype", "dtypes.fp4x2", "not allowed as dtype"),  # packed fp4 is only for weights
    ("use_g1u1", "yes", "expected one of True, False"),  # bool words outside the table
    ("doweight_stage1", "2", "unknown value"),
    ("token", "0", "integer >= 1"),  # zero tokens
    ("token", "-4", "integer >= 1"),  # negative
    ("model_dim", "7168.0", "integer"),  # float-looking int
    ("expert", "0x100", "integer"),  # not base 10
    ("inter_dim", "1_024", "integer"),  # Python's underscore digits are not plain base 10
]


@pytest.mark.parametrize("column, written, expected", BAD, ids=[f"{c}={w!r}" for c, w, _ in BAD])
def test_untuned_bad_value_names_file_row_column_value(tmp_path, column, written, expected):
    path = write_rows(tmp_path / "untuned.csv", [BASE, BASE, {**BASE, column: written}])
    with pytest.raises(FmoeCsvError) as info:
        fc.read_untuned(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"{path}, row 3 (line 4), column '{column}'" in msg
    assert (repr(written) if written else "empty value") in msg and expected in msg


TUNED_BAD = [
    ("cu_num", "-1", "integer >= 0"),  # below 0 (0 is an interpreted row: no GPU)
    ("block_m", "abc", "integer >= 1"),
    ("ksplit", "-1", "integer >= 0"),
    ("us", "nan", "finite number >= 0"),  # not finite
    ("us1", "-1.5", "finite number >= 0"),  # negative time
    ("tflops", "inf", "finite number >= 0"),
    ("bw", "1e999", "finite number >= 0"),  # overflows to inf
    ("err1", "abc%", "percentage like '0.5%'"),
    ("err2", "-0.1%", "percentage like '0.5%'"),  # negative error
    ("kernelName1", "", "expected a kernel name"),  # stage 1 always has a kernel
    ("run_1stage", "maybe", "expected one of True, False"),
]


@pytest.mark.parametrize("column, written, expected", TUNED_BAD, ids=[f"{c}={w!r}" for c, w, _ in TUNED_BAD])
def test_tuned_bad_value_names_file_row_column_value(tmp_path, column, written, expected):
    path = write_rows(tmp_path / "tuned.csv", [{**TUNED_BASE, column: written}])
    with pytest.raises(FmoeCsvError) as info:
        fc.read_tuned(path)
    msg = str(info.value)
    assert "\n" not in msg and f"{path}, row 1 (line 2), column '{column}'" in msg
    assert (repr(written) if written else "empty value") in msg and expected in msg


def test_topk_over_expert_is_a_row_error(tmp_path):
    path = write_rows(tmp_path / "untuned.csv", [{**BASE, "topk": "9", "expert": "8"}])
    with pytest.raises(FmoeCsvError, match=r"row 1 \(line 2\), column 'topk': value '9' exceeds expert=8"):
        fc.read_untuned(path)


@pytest.mark.parametrize("overrides, column", [
    pytest.param({**quant_none("dtypes.bf16"), "q_dtype_a": "dtypes.fp8"}, "q_dtype_a", id="none-but-fp8-acts"),
    pytest.param({**quant_none("dtypes.fp16"), "q_dtype_w": "dtypes.bf16"}, "q_dtype_w", id="none-but-w-not-dtype"),
    pytest.param({"q_type": "QuantType.per_Token", "q_dtype_a": "dtypes.bf16"}, "q_dtype_a", id="per-token-bf16-acts"),
    pytest.param({"q_type": "QuantType.per_1x128", "q_dtype_w": "torch.float16"}, "q_dtype_w", id="blockwise-fp16-w"),
])
def test_quant_consistency_errors_name_row_and_column(tmp_path, overrides, column):
    path = write_rows(tmp_path / "untuned.csv", [BASE, {**BASE, **overrides}])
    with pytest.raises(FmoeCsvError, match=rf"row 2 \(line 3\), column '{column}': .* does not fit q_type"):
        fc.read_untuned(path)


def test_missing_columns_name_the_file_and_columns(tmp_path):
    header = [c for c in BASE if c not in ("act_type", "q_type")]
    path = write_rows(tmp_path / "untuned.csv", [BASE], header=header)
    with pytest.raises(FmoeCsvError) as info:
        fc.read_untuned(path)
    assert str(info.value) == f"{path}: missing required column(s): act_type, q_type"
    untuned_only = write_rows(tmp_path / "only.csv", [BASE])  # an untuned file is no tuned file
    with pytest.raises(FmoeCsvError, match="missing required column.*cu_num.*block_m"):
        fc.read_tuned(untuned_only)


def test_missing_empty_header_only_and_blank_lines(tmp_path):
    with pytest.raises(FmoeCsvError, match="nope.csv: no such file"):
        fc.read_tuned(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("\n\n")
    with pytest.raises(FmoeCsvError, match="empty.csv: empty file \\(no header\\)"):
        fc.read_untuned(tmp_path / "empty.csv")
    (tmp_path / "header.csv").write_text(",".join(fr.TUNED_COLUMNS) + "\n")
    assert fc.read_tuned(tmp_path / "header.csv") == [] and fc.read_untuned(tmp_path / "header.csv") == []
    # Blank lines are skipped but still counted in line numbers: the bad row is data row 2 on line 5.
    good, bad = ",".join(BASE.values()), ",".join({**BASE, "topk": "x"}.values())
    (tmp_path / "blank.csv").write_text(f"{','.join(BASE)}\n\n{good}\n   \n{bad}\n")
    with pytest.raises(FmoeCsvError, match=r"row 2 \(line 5\), column 'topk'"):
        fc.read_untuned(tmp_path / "blank.csv")


def test_short_row_and_duplicate_header_are_errors(tmp_path):
    (tmp_path / "short.csv").write_text(",".join(BASE) + "\n16,7168\n")
    with pytest.raises(FmoeCsvError, match=r"row 1 \(line 2\): 2 fields, but the header has 12"):
        fc.read_untuned(tmp_path / "short.csv")
    write_rows(tmp_path / "dup.csv", [BASE], header=[*BASE, "token"])
    with pytest.raises(FmoeCsvError, match="column\\(s\\) token appear more than once"):
        fc.read_untuned(tmp_path / "dup.csv")


def test_untuned_ignores_extra_columns_and_reads_tuned_files(tmp_path):
    extra = write_rows(tmp_path / "u.csv", [{"note": "x", **BASE, "owner": "y"}])
    assert fc.read_untuned(extra) == [SHAPE]
    tuned_file = tmp_path / "t.csv"
    fc.write_tuned(tuned_file, [tuned(), tuned(shape=SHAPE.with_token(64))])
    assert fc.read_untuned(tuned_file) == [SHAPE, SHAPE.with_token(64)]


def test_round_trip_with_provenance_and_one_stage_row(tmp_path):
    one_stage = tuned(shape=SHAPE.with_token(1), us=9.5, us1=9.5, kernelName1="fused_1stage", err1=0.25,
                      us2=0, kernelName2="", err2=0, run_1stage=True, extra=(("gpu", "NVIDIA H100"),))
    # Rows read back with their provenance in the file's column order, so give it in that order.
    two_stage = tuned(extra=(("gpu", "NVIDIA H100"), ("triton", "3.2.0")))
    plain = tuned(shape=SHAPE.with_token(4096), us=400.25)  # lacks every provenance column
    path = tmp_path / "tuned_fmoe.csv"
    fc.write_tuned(path, [one_stage, two_stage, plain])
    assert fc.read_tuned(path) == [one_stage, two_stage, plain]
    lines = path.read_text().splitlines()
    assert lines[0].split(",")[len(fr.TUNED_COLUMNS):] == ["gpu", "triton"]  # union, first-seen order
    assert lines[1].endswith(",9.50,True,101.50,2345.60,NVIDIA H100,")  # missing triton cell written empty
    assert lines[3].endswith(",400.25,False,101.50,2345.60,,")
    fc.write_tuned(path, fc.read_tuned(path))
    assert path.read_text().splitlines() == lines  # stable: re-writing what was read changes nothing


def test_op_time_columns_append_after_older_provenance(tmp_path):
    provenance = (("device", "NVIDIA H100"), ("triton", "3.9.0"), ("us_stages", "19.75"), ("rel_l2", "0.001"))
    old = tuned(extra=provenance)  # written before the tuner recorded op times
    path = tmp_path / "tuned_fmoe.csv"
    fc.write_tuned(path, [old])
    new = tuned(shape=SHAPE.with_token(64), extra=(*provenance, ("us_eager", "101.00"), ("us_graph", "16.50"),
                                                   ("objective", "eager")))
    fc.write_tuned(path, fc.merge_tuned(fc.read_tuned(path), [new]))
    header, old_line, new_line = path.read_text().splitlines()
    assert header.split(",") == [*fr.TUNED_COLUMNS, "device", "triton", "us_stages", "rel_l2", "us_eager",
                                 "us_graph", "objective"]  # the seed columns first and unchanged, new ones last
    assert old_line.endswith(",0.001,,,") and new_line.endswith(",0.001,101.00,16.50,eager")
    assert fc.read_tuned(path) == [old, new]
    assert dict(fc.read_tuned(path)[0].extra).get("us_eager") is None  # an older row: no op times, still read


def test_header_order_and_written_forms(tmp_path):
    path = tmp_path / "t.csv"
    fc.write_tuned(path, [tuned()])
    header, row = path.read_text().splitlines()
    assert header.split(",") == [
        "cu_num", "token", "model_dim", "inter_dim", "expert", "topk", "act_type", "dtype", "q_dtype_a",
        "q_dtype_w", "q_type", "use_g1u1", "doweight_stage1", "block_m", "ksplit", "us1", "kernelName1", "err1",
        "us2", "kernelName2", "err2", "us", "run_1stage", "tflops", "bw"]
    assert row == ("132,16,7168,256,256,8,ActivationType.Silu,dtypes.bf16,dtypes.fp8,dtypes.fp8,QuantType.per_1x128,"
                   "True,False,64,1,12.50,stage1_a,0.5%,7.25,stage2_b,0%,19.75,False,101.50,2345.60")
    shipped = (fc.PACKAGE_CONFIGS / "tuned_fmoe.csv").read_text()
    assert shipped.splitlines()[0].startswith(header)  # the shipped file: same columns, then provenance


@pytest.mark.parametrize("err, text", [(0.005, "0.5%"), (0.0, "0%"), (0.123456, "12.35%"), (1e-7, "1e-05%")])
def test_err_format(err, text):  # 4 significant digits; tiny values go exponent
    assert fr.format_err(err) == text
    assert fr._err(text) == pytest.approx(err, rel=1e-3)


def test_merge_tuned_replaces_in_place_and_appends():
    a, b, c = (tuned(shape=SHAPE.with_token(t)) for t in (1, 2, 4))
    b_new = tuned(shape=SHAPE.with_token(2), us=5.0)
    other_gpu = tuned(shape=SHAPE.with_token(2), cu_num=78)  # same shape, other GPU: a new key
    d = tuned(shape=SHAPE.with_token(8))
    assert fc.merge_tuned([a, b, c], [d, b_new, other_gpu]) == [a, b_new, c, d, other_gpu]
    assert fc.merge_tuned([], [a, b]) == [a, b] and fc.merge_tuned([a], []) == [a]
    b_newer = tuned(shape=SHAPE.with_token(2), us=4.0)
    assert fc.merge_tuned([a, b], [b_new, b_newer]) == [a, b_newer]  # last new row of a key wins


@pytest.mark.parametrize("tokens, bucket", [
    (1, 1), (2, 2), (3, 4), (5, 8),  # smallest values; non-powers round up
    (1024, 1024), (1025, 2048),  # exact power stays, one past moves up
    (163840, 262144),  # large prefill batch
])
def test_token_bucket(tokens, bucket):
    assert ft.token_bucket(tokens) == bucket


@pytest.mark.parametrize("tokens", [0, -1])
def test_token_bucket_rejects_no_tokens(tokens):
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        ft.token_bucket(tokens)


@pytest.fixture
def table() -> FmoeConfigTable:
    # Buckets 4, 16 and 256; token 3 is stored under bucket 4.
    rows = [tuned(shape=SHAPE.with_token(t), us=float(t)) for t in (3, 16, 256)]
    return FmoeConfigTable(rows)


@pytest.mark.parametrize("tokens, tuned_token", [
    (3, 3), (4, 3),  # exact bucket 4, whichever token in it
    (9, 16), (16, 16),  # 9 buckets to 16: exact
    (1, 3), (2, 3),  # below every bucket: the smallest
    (32, 16),  # bucket 32: 16 is 1 step away, 256 is 3
    (128, 256),  # bucket 128: 256 is 1 step, 16 is 3
    (64, 256),  # bucket 64: 16 and 256 are both 2 steps away, the tie goes to the larger
    (8, 16),  # bucket 8: 4 and 16 both 1 step away, tie to the larger
    (1024, 256),  # above every bucket, 2 doublings from the largest: still served by it
])
def test_lookup_exact_then_nearest_bucket(table, tokens, tuned_token):
    found = table.lookup(132, SHAPE.with_token(999), tokens)  # the shape's own token is ignored
    assert found is not None and found.shape.token == tuned_token


@pytest.mark.parametrize("tokens", [
    2048,  # 3 doublings above the largest tuned bucket (256)
    100000,  # far above every bucket
])
def test_lookup_too_far_from_every_bucket_misses(table, tokens):
    assert table.lookup(132, SHAPE, tokens) is None  # the heuristic serves it


def test_lookup_misses_other_gpu_or_shape(table):
    assert table.lookup(78, SHAPE, 16) is None  # other cu_num
    other = FmoeShape(**{**SHAPE.__dict__, "inter_dim": 512})
    assert table.lookup(132, other, 16) is None
    assert table.lookup(132, FmoeShape(**{**SHAPE.__dict__, "doweight_stage1": True}), 16) is None
    assert len(table.rows) == 3


def test_duplicates_across_files_keep_lower_us_and_leave_files_alone(tmp_path):
    first, second = tmp_path / "a_tuned_fmoe.csv", tmp_path / "b_tuned_fmoe.csv"
    slow, fast = tuned(shape=SHAPE.with_token(16), us=30.0), tuned(shape=SHAPE.with_token(13), us=20.0)  # bucket 16
    keep = tuned(shape=SHAPE.with_token(64), us=50.0)
    fc.write_tuned(first, [slow, keep])
    fc.write_tuned(second, [fast])
    before = first.read_bytes(), second.read_bytes()
    with pytest.warns(UserWarning) as record:
        table = FmoeConfigTable.from_files([first, second])
    [warning] = record
    msg = str(warning.message)
    assert "\n" not in msg and f"{first}, row 1 (line 2)" in msg and f"{second}, row 1 (line 2)" in msg
    assert f"keeping {second}, row 1 (line 2) (us=20)" in msg
    assert table.rows == [fast, keep]
    assert table.lookup(132, SHAPE, 16) == fast
    assert (first.read_bytes(), second.read_bytes()) == before


def test_equal_us_duplicate_keeps_the_first_file(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    fc.write_tuned(a, [tuned(kernelName1="from_a")])
    fc.write_tuned(b, [tuned(kernelName1="from_b")])
    with pytest.warns(UserWarning, match="duplicate fused-MoE config"):
        table = FmoeConfigTable.from_files([a, b])
    assert [r.kernelName1 for r in table.rows] == ["from_a"]


def test_from_files_names_a_bad_file(tmp_path):
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    fc.write_tuned(good, [tuned()])
    write_rows(bad, [{**TUNED_BASE, "us": "fast"}])
    with pytest.raises(FmoeCsvError, match=f"{bad}, row 1 \\(line 2\\), column 'us'"):
        FmoeConfigTable.from_files([good, bad])


@pytest.mark.parametrize("kind", ["stage1", "stage2", "1stage"])
@pytest.mark.parametrize("quant", ["none", "per_token", "per_1x128"])
def test_block_m_of_a_tritune_kernel_name(kind, quant):
    # The store's reading of the names MoeConfig writes (the store may not import the kernels): every kind, quant and
    # activation, the smallest and a three-digit BLOCK_SIZE_M, every field set.
    for act in ("silu", "gelu"):
        for bm in (16, 128):
            config = MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=256, KSPLIT=2, BLOCK_SIZE_D=64, USE_TMA=1)
            assert fr.name_block_m(config.name(kind, quant, act)) == bm
    for other in ("stage1_a", "", "moe_ck2stages_gemm1_256x32x64x128_1x4_TypeCast_v3_Nswizzle0_Quant3_MulRoutedWeight1",
                  "moe_stage1_none_silu_BN32", "moe_stage1_none_relu_BM16"):
        assert fr.name_block_m(other) is None  # another tool's name (or none): nothing to check block_m against


@pytest.mark.parametrize("column", ["kernelName1", "kernelName2"])
def test_block_m_must_be_the_kernel_names_block_size_m(tmp_path, column):
    names = {"kernelName1": MoeConfig(BLOCK_SIZE_M=64).name("stage1", "per_1x128"),
             "kernelName2": MoeConfig(BLOCK_SIZE_M=64).name("stage2", "per_1x128")}
    path = write_rows(tmp_path / "t.csv", [{**TUNED_BASE, **names}])
    assert fc.read_tuned(path)[0].block_m == 64  # agrees
    wrong = MoeConfig(BLOCK_SIZE_M=32).name("stage1" if column == "kernelName1" else "stage2", "per_1x128")
    write_rows(path, [{**TUNED_BASE, **names}, {**TUNED_BASE, **names, column: wrong}])
    with pytest.raises(FmoeCsvError) as err:
        fc.read_tuned(path)
    assert str(err.value) == (f"{path}, row 2 (line 3), column 'block_m': value '64' is not the BLOCK_SIZE_M of "
                              f"{column} '{wrong}' (32)")


@pytest.fixture
def package_configs(tmp_path, monkeypatch) -> Path:
    """A stand-in package configs folder: a main file plus two model files (and one the glob must skip)."""
    folder = tmp_path / "configs"
    (folder / "model_configs").mkdir(parents=True)
    fc.write_tuned(folder / "tuned_fmoe.csv", [tuned(cu_num=132)])
    fc.write_tuned(folder / "model_configs" / "z_tuned_fmoe.csv", [tuned(cu_num=114)])
    fc.write_tuned(folder / "model_configs" / "a_tuned_fmoe.csv", [tuned(cu_num=78)])
    fc.write_tuned(folder / "model_configs" / "untuned_notes.csv", [tuned(cu_num=1)])
    monkeypatch.setattr(fc, "PACKAGE_CONFIGS", folder)
    monkeypatch.delenv(knobs.CONFIG_FMOE, raising=False)
    ft.reload_fmoe_configs()
    yield folder
    ft.reload_fmoe_configs()


def test_package_files_order(package_configs):
    names = [p.relative_to(package_configs).as_posix() for p in fc.package_config_files()]
    assert names == ["tuned_fmoe.csv", "model_configs/a_tuned_fmoe.csv", "model_configs/z_tuned_fmoe.csv"]
    assert fc.default_config_files() == fc.package_config_files()
    assert sorted(r.cu_num for r in ft.default_table().rows) == [78, 114, 132]


def test_env_override_replaces_package_files(package_configs, tmp_path, monkeypatch):
    mine, also = tmp_path / "mine.csv", tmp_path / "also.csv"
    fc.write_tuned(mine, [tuned(cu_num=304)])
    fc.write_tuned(also, [tuned(cu_num=80)])
    monkeypatch.setenv(knobs.CONFIG_FMOE, f"{mine}:{also}")
    assert fc.default_config_files() == [mine, also]
    assert [r.cu_num for r in ft.default_table().rows] == [304, 80]
    assert ft.default_table().lookup(132, SHAPE, 16) is None  # the package's H100 row is not read


def test_reload_drops_the_cached_table(package_configs, tmp_path, monkeypatch):
    first = ft.default_table()
    assert ft.default_table() is first  # cached
    mine = tmp_path / "mine.csv"
    fc.write_tuned(mine, [tuned(cu_num=304)])
    monkeypatch.setenv(knobs.CONFIG_FMOE, str(mine))
    assert ft.default_table() is first  # env change unseen until reload
    ft.reload_fmoe_configs()
    assert ft.default_table() is not first and [r.cu_num for r in ft.default_table().rows] == [304]


def test_write_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "tuned_fmoe.csv"
    fc.write_tuned(path, [tuned()])
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        fc.write_tuned(path, [tuned(us=1.0), tuned(shape=SHAPE.with_token(2))])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned_fmoe.csv"]  # no temp file, no lock beside it


@pytest.mark.parametrize("bad, match", [
    pytest.param(dict(act_type="relu"), "act_type='relu'", id="unknown-canonical-act"),
    pytest.param(dict(dtype="bfloat16"), "dtype='bfloat16'", id="torch-name-not-canonical"),
    pytest.param(dict(q_type="none"), "q_dtype_a", id="none-with-fp8-inputs"),
    pytest.param(dict(topk=300), "exceeds expert", id="topk-over-expert"),
    pytest.param(dict(token=0), "token=0", id="no-tokens"),
    pytest.param(dict(use_g1u1=1), "use_g1u1=1", id="int-not-bool"),
])
def test_shape_checks_on_construction(bad, match):
    with pytest.raises(ValueError, match=match):
        FmoeShape(**{**SHAPE.__dict__, **bad})


def test_tuned_checks_on_construction():
    with pytest.raises(ValueError, match="us=inf"):
        tuned(us=float("inf"))
    with pytest.raises(ValueError, match="extra names"):
        tuned(extra=(("us", "1"),))  # provenance may not shadow a fixed column
    row = tuned(extra=[("host", " node7 "), ("empty", "")])  # list in, tuple out; stripped; empty dropped
    assert row.extra == (("host", "node7"),) and hash(row) == hash(tuned(extra=(("host", "node7"),)))


def test_shape_keys():
    assert SHAPE.shape_key() == (7168, 256, 256, 8, "silu", "bf16", "fp8", "fp8", "per_1x128", True, False)
    assert SHAPE.with_token(4).shape_key() == SHAPE.shape_key() and SHAPE.with_token(4).token == 4
    assert SHAPE.key().startswith("token=16,model_dim=7168,") and SHAPE.key() != SHAPE.with_token(4).key()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a table without duplicates never warns
        assert FmoeConfigTable([tuned()]).lookup(132, SHAPE, 16) == tuned()


def test_mxfp4_rows_read_and_check_their_dtypes(tmp_path):
    mx = {**BASE, "q_dtype_a": "dtypes.bf16", "q_dtype_w": "dtypes.fp4x2", "q_type": "QuantType.per_1x32"}
    [shape] = fc.read_untuned(write_rows(tmp_path / "mx.csv", [mx]))
    assert (shape.q_type, shape.q_dtype_a, shape.q_dtype_w) == ("per_1x32", "bf16", "fp4x2")
    with pytest.raises(FmoeCsvError, match="'q_dtype_w': value 'dtypes.fp8' does not fit q_type QuantType.per_1x32; "
                                           "expected dtypes.fp4x2"):
        fc.read_untuned(write_rows(tmp_path / "bad.csv", [{**mx, "q_dtype_w": "dtypes.fp8"}]))
    assert shape.quant == "per_1x32"
    [a8] = fc.read_untuned(write_rows(tmp_path / "a8.csv", [{**mx, "q_dtype_a": "dtypes.fp8"}]))  # fp8 activations
    assert (a8.q_type, a8.q_dtype_a, a8.quant) == ("per_1x32", "fp8", "per_1x32_a8")
    fc.write_untuned(tmp_path / "again.csv", [a8])  # written back as aiter spells it
    assert fc.read_untuned(tmp_path / "again.csv") == [a8]
    assert "dtypes.fp8,dtypes.fp4x2,QuantType.per_1x32" in (tmp_path / "again.csv").read_text()
    with pytest.raises(FmoeCsvError, match="'q_dtype_a': .* expected dtypes.bf16 or dtypes.fp8"):  # dtype or fp8
        fc.read_untuned(write_rows(tmp_path / "bad_a.csv", [{**mx, "q_dtype_a": "dtypes.fp16"}]))
