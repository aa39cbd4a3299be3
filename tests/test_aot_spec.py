"""The run spec (tritune.aot.spec): text round trip, parse errors with line numbers, placeholders, resolve on a
small MoE-like bundle, and the specialization check. The bundle helpers are shared with test_aot_main_c.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tritune.aot.spec import (
    Resolved,
    RunSpec,
    SpecArg,
    SpecError,
    SpecTolerance,
    check_specialization,
    evaluation_order,
    resolve,
    substitute,
)
from tritune.aot.tdat import TdatError, write_tensor

# An artifact of the MoE stage-1 kernel: its config parameters and runtime arguments (name, type, hint).
MOE_PARAMS = {
    "BLOCK_SIZE_M": 64,
    "BLOCK_SIZE_N": 128,
    "BLOCK_SIZE_K": 64,
    "GROUP_SIZE_M": 8,
    "num_warps": 4,
    "num_stages": 3,
}
MOE_ARGDESCS = [
    ("a", "p", 16),
    ("b", "p", 16),
    ("c", "p", 16),
    ("topk_weights", "p", 16),
    ("sorted_token_ids", "p", 16),
    ("expert_ids", "p", 16),
    ("num_tokens_post_padded", "p", 16),
    ("workspace", "p", 0),
    ("N", "i", 16),
    ("K", "i", 16),
    ("EM", "i", 0),
    ("num_valid_tokens", "i", 0),
    ("stride_am", "i", 16),
    ("stride_ak", "i", 1),
    ("stride_be", "l", 16),
    ("scale", "f", 0),
]
T, TOPK, E, K, N = 32, 2, 4, 64, 128

# Written by hand, so values and args interleave: num_post needs an arg read before it.
MOE_SPEC = """tritune-spec 1
# MoE stage 1, shaped like tritune.kernels.fused_moe
kernel\tmoe_stage1
value\tT\t32
value\ttopk\t2

arg\ta\tin\tdata/a.tdat
arg\tb\tin\tdata/b.tdat
arg\tc\tout\tdata/expected.BLOCK_SIZE_M={BLOCK_SIZE_M}.tdat
arg\ttopk_weights\tin\tdata/topk_weights.tdat
arg\tsorted_token_ids\tin\tdata/sorted_token_ids.BLOCK_SIZE_M={BLOCK_SIZE_M}.tdat
arg\texpert_ids\tin\tdata/expert_ids.BLOCK_SIZE_M={BLOCK_SIZE_M}.tdat
arg\tnum_tokens_post_padded\tin\tdata/num_tokens_post_padded.BLOCK_SIZE_M={BLOCK_SIZE_M}.tdat
value\tnum_post\tfirst(num_tokens_post_padded)
arg\tworkspace\tscratch\tcdiv(numel(c), 1024) * 4
arg\tN\ti32\t128
arg\tK\ti32\t64
arg\tEM\ti32\tnumel(sorted_token_ids)
arg\tnum_valid_tokens\ti32\tT * topk
arg\tstride_am\ti32\tK
arg\tstride_ak\ti32\t1
arg\tstride_be\ti64\tN * K
arg\tscale\tf32\t0.5
grid\tcdiv(num_post, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N)\t1\t1
tolerance\t0.02\t0.02\t0.0\t0.01
"""


def make_moe_bundle(root: Path, block_m: int = 64, seed: int = 0) -> dict[str, int]:
    """Write the data files MOE_SPEC names under root/data and the spec under root/specs; returns the sizes."""
    g = torch.Generator().manual_seed(seed)
    data = root / "data"
    topk_ids = torch.randint(0, E, (T, TOPK), generator=g, dtype=torch.int32)
    counts = torch.bincount(topk_ids.flatten().long(), minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    num_post = int(padded.sum())
    em = T * TOPK + E * (block_m - 1)  # the most padding moe_align can need
    sorted_ids = torch.full((em,), T * TOPK, dtype=torch.int32)
    order = torch.argsort(topk_ids.flatten(), stable=True).to(torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)[:-1]])
    flat_sorted = topk_ids.flatten()[order.long()]
    for expert in range(E):
        rows = order[flat_sorted == expert]
        sorted_ids[starts[expert] : starts[expert] + len(rows)] = rows
    expert_ids = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), padded // block_m)
    expert_ids = torch.cat(
        [expert_ids, torch.full(((em + block_m - 1) // block_m - len(expert_ids),), -1, dtype=torch.int32)]
    )
    tag = f"BLOCK_SIZE_M={block_m}"
    write_tensor(data / "a.tdat", "a", torch.randn(T, K, generator=g).to(torch.bfloat16))
    write_tensor(data / "b.tdat", "b", torch.randn(E, N, K, generator=g).to(torch.bfloat16))
    write_tensor(data / "topk_weights.tdat", "topk_weights", torch.rand(T, TOPK, generator=g))
    write_tensor(data / f"expected.{tag}.tdat", "c", torch.randn(T * TOPK, N, generator=g).to(torch.bfloat16))
    write_tensor(data / f"sorted_token_ids.{tag}.tdat", "sorted_token_ids", sorted_ids, {"block_size_m": block_m})
    write_tensor(data / f"expert_ids.{tag}.tdat", "expert_ids", expert_ids, {"block_size_m": block_m})
    write_tensor(data / f"num_tokens_post_padded.{tag}.tdat", "n", torch.tensor([num_post], dtype=torch.int32))
    (root / "specs").mkdir(parents=True, exist_ok=True)
    (root / "specs" / "moe_stage1.spec").write_text(MOE_SPEC)
    return {"num_post": num_post, "EM": em}


def expected_resolution(sizes: dict[str, int]) -> dict:
    """What MOE_SPEC resolves to, computed by hand."""
    return {
        "values": {"T": T, "topk": TOPK, "num_post": sizes["num_post"]},
        "int_args": {
            "N": N,
            "K": K,
            "EM": sizes["EM"],
            "num_valid_tokens": T * TOPK,
            "stride_am": K,
            "stride_ak": 1,
            "stride_be": N * K,
        },
        "float_args": {"scale": 0.5},
        "scratch": {"workspace": (T * TOPK * N + 1023) // 1024 * 4},
        "grid": (sizes["num_post"] // 64 * (N // 128), 1, 1),
    }


@pytest.fixture
def bundle(tmp_path) -> tuple[Path, dict[str, int]]:
    return tmp_path, make_moe_bundle(tmp_path)


def _small_spec(**changes) -> RunSpec:
    fields = dict(
        kernel="k",
        values=(("B", "BLOCK * 2"),),
        args=(SpecArg("x", "in", "x.{BLOCK}.tdat"), SpecArg("y", "out", "y.tdat"), SpecArg("n", "i32", "numel(x)")),
        grid=("cdiv(n, B)", "1", "1"),
        tolerance=SpecTolerance(1e-05, 0.01, 0.0, 0.02),
    )
    fields.update(changes)
    return RunSpec(**fields)


# ---------------------------------------------------------------- text form


def test_to_text_is_exact_and_parses_back_equal():
    spec = _small_spec()
    text = spec.to_text()
    assert text == (
        "tritune-spec 1\n"
        "kernel\tk\n"
        "value\tB\tBLOCK * 2\n"
        "arg\tx\tin\tx.{BLOCK}.tdat\n"
        "arg\ty\tout\ty.tdat\n"
        "arg\tn\ti32\tnumel(x)\n"
        "grid\tcdiv(n, B)\t1\t1\n"
        "tolerance\t1e-05\t0.01\t0.0\t0.02\n"
    )
    assert RunSpec.parse(text) == spec


def test_hand_written_spec_parses_and_round_trips():
    spec = RunSpec.parse(MOE_SPEC, "moe_stage1.spec")
    assert spec.kernel == "moe_stage1"
    assert spec.values == (("T", "32"), ("topk", "2"), ("num_post", "first(num_tokens_post_padded)"))
    assert [a.name for a in spec.args] == [name for name, _, _ in MOE_ARGDESCS]
    assert spec.args[2] == SpecArg("c", "out", "data/expected.BLOCK_SIZE_M={BLOCK_SIZE_M}.tdat")
    assert spec.grid == ("cdiv(num_post, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N)", "1", "1")
    assert spec.tolerance == SpecTolerance(0.02, 0.02, 0.0, 0.01)
    text = spec.to_text()
    assert RunSpec.parse(text) == spec
    # num_post is written after the arg it reads, not with the other values.
    lines = text.splitlines()
    assert lines.index("value\tnum_post\tfirst(num_tokens_post_padded)") > lines.index(
        "arg\tnum_tokens_post_padded\tin\tdata/num_tokens_post_padded.BLOCK_SIZE_M={BLOCK_SIZE_M}.tdat"
    )


def test_values_may_use_later_args_when_built_in_python():
    spec = _small_spec(values=(("B", "BLOCK * 2"), ("M", "n * 2")), grid=("M", "1", "1"))
    order = [item.name for item in evaluation_order(spec)]
    assert order == ["B", "x", "y", "n", "M"]
    assert RunSpec.parse(spec.to_text()) == spec


def test_comments_blank_lines_and_crlf_are_ignored():
    text = _small_spec().to_text().replace("\n", "\r\n").replace("kernel", "# a comment\r\n\r\n   \r\nkernel", 1)
    assert RunSpec.parse(text) == _small_spec()


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(values=(("B", "n"),), args=(SpecArg("n", "i32", "B"),)), "no order defines"),  # a cycle
        (
            dict(values=(("A", "numel(x)"), ("B", "1")), args=(SpecArg("y", "i32", "B"), SpecArg("x", "in", "x"))),
            "no order defines",
        ),  # values out of order
        (dict(args=(SpecArg("x", "bogus", "x"),)), "unknown role"),
        (dict(args=(SpecArg("x", "f32", "nan"),)), "not a decimal number"),
        (dict(args=(SpecArg("x", "in", "a\tb"),)), "without tabs"),
        (dict(values=(("x", "1"),)), "defined twice"),
        (dict(grid=("1", "1")), "3"),
        (dict(grid=("x", "1", "1")), "not an integer"),  # a pointer arg used as a number
        (dict(grid=("numel(n)", "1", "1")), "want in or out"),
        (dict(kernel="moe-stage1"), "not an identifier"),
    ],
)
def test_invalid_specs_are_refused_on_construction(changes, match):
    with pytest.raises(SpecError, match=match):
        _small_spec(**changes)


def test_tolerance_must_be_finite_and_non_negative():
    with pytest.raises(SpecError, match="atol"):
        SpecTolerance(-1.0, 0.0, 0.0, 0.0)
    with pytest.raises(SpecError, match="max_rel_l2"):
        SpecTolerance(0.0, 0.0, 0.0, float("inf"))


def _replace_line(lineno: int, new: str) -> str:
    lines = MOE_SPEC.split("\n")
    lines[lineno - 1] = new
    return "\n".join(lines)


@pytest.mark.parametrize(
    "lineno, new, match",
    [
        (1, "tritune-spec 2", "first line must be 'tritune-spec 1'"),
        (4, "values\tT\t32", "unknown line kind 'values'"),
        (4, "value\tT\t32\textra", "'value' takes 2 TAB-separated fields, got 3"),
        (4, "value T 32", "unknown line kind 'value T 32'"),  # spaces, not TABs
        (4, "value\tT\t", "empty field"),
        (4, "kernel\tagain", "second 'kernel' line"),
        (4, "value\t2T\t32", "not an identifier"),
        (5, "value\tT\t2", "'T' already defined on line 4"),
        (7, "arg\ta\tinput\tdata/a.tdat", "unknown role 'input'"),
        (4, "value\tT\t32 +", "expected a number"),
        (23, "arg\tscale\tf32\tnan", "not a decimal number"),
        (23, "arg\tscale\tf32\t1e39", "does not fit in a float32"),
        (25, "tolerance\t0.02\t-0.02\t0.0\t0.01", "rtol"),
        (25, "tolerance\t0.02\t0.02\t0.0", "'tolerance' takes 4"),
        (4, "value\tT\ttopk * 16", "'topk' is used before its definition on line 5"),
        (14, "value\tnum_post\tfirst(later)", "not an argument"),
        (14, "value\tnum_post\tfirst(workspace)", "a scratch argument"),
        (7, "value\tX\tnumel(b)", "'b' is used before its definition on line 8"),
        (16, "arg\tN\ti32\tnumel(workspace)", "a scratch argument"),
        (16, "arg\tN\ti32\ta", "'a' is a in argument, not an integer"),
        (24, "grid\tcdiv(later_value, 64)\t1\t1\nvalue\tlater_value\t7", "'later_value' is used before"),
    ],
)
def test_parse_errors_name_the_line(lineno, new, match):
    with pytest.raises(SpecError, match=match) as info:
        RunSpec.parse(_replace_line(lineno, new), "specs/moe_stage1.spec")
    assert str(info.value).startswith(f"specs/moe_stage1.spec:{lineno}: ")


@pytest.mark.parametrize("keyword", ["kernel", "grid", "tolerance"])
def test_a_missing_line_is_an_error(keyword):
    text = "\n".join(line for line in MOE_SPEC.split("\n") if not line.startswith(keyword + "\t"))
    with pytest.raises(SpecError, match=f"no '{keyword}' line"):
        RunSpec.parse(text, "s.spec")


# ---------------------------------------------------------------- placeholders


def test_substitute():
    params = {"BLOCK_SIZE_M": 64, "num_warps": 4}
    assert substitute("expected.BLOCK_SIZE_M={BLOCK_SIZE_M}.w{num_warps}.tdat", params) == (
        "expected.BLOCK_SIZE_M=64.w4.tdat"
    )
    assert substitute("plain.tdat", params) == "plain.tdat"
    for bad, match in [
        ("x.{BLOCK_SIZE_N}.tdat", "no artifact parameter BLOCK_SIZE_N"),
        ("x.{BLOCK_SIZE_M.tdat", "unclosed"),
        ("x.}.tdat", "stray"),
        ("x.{}.tdat", "not a name"),
        ("x.{1X}.tdat", "not a name"),
    ]:
        with pytest.raises(SpecError, match=match):
            substitute(bad, params)


# ---------------------------------------------------------------- resolve


def test_resolve_moe_bundle(bundle):
    root, sizes = bundle
    spec = RunSpec.parse(MOE_SPEC)
    resolved = resolve(spec, MOE_PARAMS, root)
    expected = expected_resolution(sizes)
    assert resolved.values == expected["values"]
    assert resolved.int_args == expected["int_args"]
    assert resolved.float_args == expected["float_args"]
    assert resolved.scratch == expected["scratch"]
    assert resolved.grid == expected["grid"]
    assert resolved.files["c"] == root / "data" / "expected.BLOCK_SIZE_M=64.tdat"
    assert set(resolved.files) == {
        "a",
        "b",
        "c",
        "topk_weights",
        "sorted_token_ids",
        "expert_ids",
        "num_tokens_post_padded",
    }
    assert list(resolved.roles) == [name for name, _, _ in MOE_ARGDESCS]
    check_specialization(resolved, MOE_ARGDESCS)


def test_resolve_per_block_size_reads_that_block_size_files(tmp_path):
    sizes = make_moe_bundle(tmp_path, block_m=16)
    resolved = resolve(RunSpec.parse(MOE_SPEC), {**MOE_PARAMS, "BLOCK_SIZE_M": 16}, tmp_path)
    assert resolved.files["sorted_token_ids"].name == "sorted_token_ids.BLOCK_SIZE_M=16.tdat"
    assert resolved.int_args["EM"] == sizes["EM"] == T * TOPK + E * 15
    assert resolved.grid == (sizes["num_post"] // 16, 1, 1)


def test_resolve_missing_file_names_it(bundle):
    root, _ = bundle
    (root / "data" / "expert_ids.BLOCK_SIZE_M=64.tdat").unlink()
    with pytest.raises(TdatError, match=r"expert_ids\.BLOCK_SIZE_M=64\.tdat: no such file"):
        resolve(RunSpec.parse(MOE_SPEC), MOE_PARAMS, root)


def test_resolve_missing_parameter_and_placeholder(bundle):
    root, _ = bundle
    params = {k: v for k, v in MOE_PARAMS.items() if k != "BLOCK_SIZE_N"}
    with pytest.raises(SpecError, match=r"grid\[0\].*unknown name 'BLOCK_SIZE_N'"):
        resolve(RunSpec.parse(MOE_SPEC), params, root)
    params = {k: v for k, v in MOE_PARAMS.items() if k != "BLOCK_SIZE_M"}
    with pytest.raises(SpecError, match=r"arg 'c'.*no artifact parameter BLOCK_SIZE_M"):
        resolve(RunSpec.parse(MOE_SPEC), params, root)


@pytest.mark.parametrize(
    "lineno, new, match",
    [
        (16, "arg\tN\ti32\t2147483648", "does not fit in an i32"),
        (15, "arg\tworkspace\tscratch\t-1", "-1 bytes"),
        (14, "value\tnum_post\tfirst(a)", "first element wanted from a bf16 tensor"),
        (14, "value\tnum_post\t1 / (T - 32)", "division by zero"),
    ],
)
def test_resolve_evaluation_errors(bundle, lineno, new, match):
    root, _ = bundle
    with pytest.raises(SpecError, match=match):
        resolve(RunSpec.parse(_replace_line(lineno, new)), MOE_PARAMS, root)


def test_resolve_refuses_a_spec_name_that_is_a_parameter(bundle):
    root, _ = bundle
    with pytest.raises(SpecError, match="'num_warps' is also an artifact parameter"):
        resolve(
            RunSpec.parse(_replace_line(4, "value\tnum_warps\t32").replace("T * topk", "32 * topk")), MOE_PARAMS, root
        )


# ---------------------------------------------------------------- specialization


def _resolved(**changes) -> Resolved:
    base = dict(
        files={"x": Path("x.tdat")},
        values={},
        int_args={"n": 64, "one": 1},
        float_args={"s": 0.5},
        grid=(4, 1, 1),
        scratch={"w": 0},
        roles={"x": "in", "w": "scratch", "n": "i32", "one": "i64", "s": "f32"},
    )
    base.update(changes)
    return Resolved(**base)


ARGDESCS = [("x", "p", 16), ("w", "p", 0), ("n", "i", 16), ("one", "l", 1), ("s", "f", 0)]


def test_check_specialization_accepts_a_fitting_artifact():
    check_specialization(_resolved(), ARGDESCS)


@pytest.mark.parametrize(
    "changes, argdescs, match",
    [
        (dict(int_args={"n": 100, "one": 1}), ARGDESCS, r"'n' = 100 breaks .* \(divisible by 16\)"),
        (dict(int_args={"n": 64, "one": 2}), ARGDESCS, r"'one' = 2 breaks .* \(equal to 1\)"),
        ({}, ARGDESCS[:-1], "spec arg 's' is not an argument of the artifact"),
        ({}, [*ARGDESCS, ("extra", "p", 0)], "artifact argument 'extra' has no spec arg"),
        ({}, [("x", "i", 0), *ARGDESCS[1:]], r"'x' \(type 'i'\) is given a spec arg of role in"),
        ({}, [*ARGDESCS[:2], ("n", "l", 16), *ARGDESCS[3:]], "role i32"),
        ({}, [*ARGDESCS[:4], ("s", "p", 0)], "role f32"),
        ({}, [("x", "q", 0), *ARGDESCS[1:]], "unknown type 'q'"),
        ({}, [("x", "p", 8), *ARGDESCS[1:]], "unknown hint 8"),
        ({}, [("x", "p", 1), *ARGDESCS[1:]], "cannot have hint 1"),
        (dict(grid=(0, 1, 1)), ARGDESCS, r"grid\[0\] = 0 is outside"),
        (dict(grid=(1, 65536, 1)), ARGDESCS, r"grid\[1\] = 65536 is outside 1..65535"),
        (dict(grid=(1 << 20, 1 << 12, 1)), ARGDESCS, "2\\*\\*32"),
    ],
)
def test_check_specialization_refuses(changes, argdescs, match):
    with pytest.raises(SpecError, match=match):
        check_specialization(_resolved(**changes), argdescs)


def test_a_name_may_be_a_function_name():
    # Kernels have parameters called numel or min; a name followed by '(' is a call, any other use a variable.
    spec = RunSpec(kernel="k", values=(("min", "3"),), args=(SpecArg("numel", "i32", "min * 2"),),
                   grid=("numel", "min(numel, 4)", "1"), tolerance=SpecTolerance(0, 0, 0, 0))
    assert RunSpec.parse(spec.to_text()) == spec
