"""The grouped-GEMM manual tuning module: device limits, configs, pruning rules, search space, results, and the
context that keeps a tuning loop going past a failing config."""

import dataclasses
import logging
import math

import pandas as pd
import pytest
from triton.runtime.errors import OutOfResources

from tritune.device import current_device
from tritune.kernels.grouped_gemm_config import smem_bytes
from tritune.tuners import grouped_gemm_tuning as ggt
from tritune.tuners.grouped_gemm_tuning import (
    BACKWARD_DW_RULES,
    BACKWARD_DX_RULES,
    FORWARD_RULES,
    DeviceProperties,
    KernelConfig,
    KernelConfigBackward_dW,
    KernelConfigBackward_dX,
    KernelConfigForward,
    KernelResult,
    TritonTuningContext,
    check_resources,
    exceeds_smem,
    get_device_properties,
    get_kernel_configs,
    permute_x_with_permute_y,
    prune_kernel_configs_backward_dW,
    prune_kernel_configs_backward_dX,
    prune_kernel_configs_fwd,
    tma_load_dy_with_permute_y,
    tma_load_x_with_permute_x,
    tma_store_with_permute_x,
    tma_store_with_permute_y,
    uses_tma,
)

# H100 limits, fixed so these tests do not depend on the machine they run on.
BIG = DeviceProperties(NUM_SM=132, NUM_REGS=65536, SIZE_SMEM=232448, WARP_SIZE=32)
TILES = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, num_warps=4, num_stages=3)
KERNELS = [
    (KernelConfigForward, prune_kernel_configs_fwd, FORWARD_RULES),
    (KernelConfigBackward_dX, prune_kernel_configs_backward_dX, BACKWARD_DX_RULES),
    (KernelConfigBackward_dW, prune_kernel_configs_backward_dW, BACKWARD_DW_RULES),
]
PRUNE = {cls: prune for cls, prune, _ in KERNELS}
RULES = {cls: rules for cls, _, rules in KERNELS}


# --- Device properties. ---------------------------------------------------------------------------------------


def test_device_properties_come_from_current_device_and_are_cached():
    device = current_device()
    props = get_device_properties()
    assert props == DeviceProperties(NUM_SM=device.sm_count, NUM_REGS=device.regs_per_block,
                                     SIZE_SMEM=device.max_shared_mem, WARP_SIZE=device.warp_size)
    assert props.NUM_SM > 0 and props.SIZE_SMEM > 0 and props.WARP_SIZE in (32, 64)
    assert get_device_properties() is props


# --- Configs (re-exported from the config module). ------------------------------------------------------------


def test_reexports_are_the_config_module_classes():
    from tritune.kernels import grouped_gemm_config as cfg

    assert ggt.KernelConfig is cfg.KernelConfig and ggt.KernelConfigForward is cfg.KernelConfigForward
    assert ggt.KernelConfigBackward_dW is cfg.KernelConfigBackward_dW
    assert ggt.KernelConfigBackward_dX is cfg.KernelConfigBackward_dX


def test_kernel_config_defaults():
    config = KernelConfig()
    assert (config.BLOCK_SIZE_M, config.BLOCK_SIZE_N, config.BLOCK_SIZE_K) == (32, 32, 32)
    assert (config.num_warps, config.num_stages, config.flatten) == (4, 2, True)
    assert not (config.permute_x or config.permute_y or config.fuse_mul_post or config.use_tma_store)
    assert not (KernelConfigForward().use_tma_load_w or KernelConfigForward().use_tma_load_x)
    assert not (KernelConfigBackward_dW().use_tma_load_dy or KernelConfigBackward_dW().use_tma_load_x)
    assert not (KernelConfigBackward_dX().use_tma_load_dy or KernelConfigBackward_dX().use_tma_load_w)


TUNING = "BLOCK_SIZE_M=32,BLOCK_SIZE_N=32,BLOCK_SIZE_K=32,num_warps=4,num_stages=2,flatten=True"


@pytest.mark.parametrize(
    "config, kwargs, expected",
    [
        (KernelConfig(), {}, ""),  # no flags on, no extras: empty label
        (KernelConfig(permute_x=True), {}, "permute_x"),  # one fusion flag
        (KernelConfig(permute_y=True, fuse_mul_post=True), {}, "permute_y,fuse_mul_post"),  # two flags, field order
        (KernelConfig(), {"include_tuning_params": True}, TUNING),  # tuning params only
        # TMA flags: base field use_tma_store comes before the subclass's load flags
        (KernelConfigForward(use_tma_load_w=True, use_tma_store=True), {"include_tma": True},
         "use_tma_store,use_tma_load_w"),
        (KernelConfigForward(use_tma_load_w=True), {}, ""),  # TMA flags hidden without include_tma
        # everything: flags, then tuning params, then TMA flags
        (KernelConfigBackward_dX(permute_x=True, use_tma_load_dy=True),
         {"include_tuning_params": True, "include_tma": True}, f"permute_x,{TUNING},use_tma_load_dy"),
    ],
)
def test_to_string(config, kwargs, expected):
    assert config.to_string(**kwargs) == expected


@pytest.mark.parametrize(
    "config",
    [
        KernelConfigForward(),  # all defaults
        KernelConfigForward(BLOCK_SIZE_M=128, permute_x=True, use_tma_load_w=True),  # forward with flags
        KernelConfigBackward_dW(use_tma_load_dy=True, num_stages=5),  # dW-only field
        KernelConfigBackward_dX(use_tma_load_w=True, use_tma_store=True),  # dX-only field + base TMA flag
    ],
)
def test_from_dict_round_trip(config):
    assert type(config).from_dict(config.to_dict()) == config


def test_from_dict_unknown_key_is_named():
    params = {**KernelConfigForward().to_dict(), "use_tma_load_dy": True}  # a dX/dW field on the forward
    with pytest.raises(ValueError, match="use_tma_load_dy"):
        KernelConfigForward.from_dict(params)


# --- Pruning rules, one by one. -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, flags, rule",
    [
        (KernelConfigForward, ("use_tma_load_x", "permute_x"), tma_load_x_with_permute_x),  # fwd: TMA X vs gather
        (KernelConfigForward, ("permute_x", "permute_y"), permute_x_with_permute_y),  # fwd: both permutes
        (KernelConfigForward, ("use_tma_store", "permute_y"), tma_store_with_permute_y),  # fwd: TMA store vs scatter
        (KernelConfigBackward_dX, ("use_tma_load_dy", "permute_y"), tma_load_dy_with_permute_y),  # dX: TMA dY
        (KernelConfigBackward_dX, ("permute_x", "permute_y"), permute_x_with_permute_y),  # dX: both permutes
        (KernelConfigBackward_dX, ("use_tma_store", "permute_x"), tma_store_with_permute_x),  # dX: TMA store
        (KernelConfigBackward_dW, ("use_tma_load_dy", "permute_y"), tma_load_dy_with_permute_y),  # dW: TMA dY
        (KernelConfigBackward_dW, ("use_tma_load_x", "permute_x"), tma_load_x_with_permute_x),  # dW: TMA X
        (KernelConfigBackward_dW, ("permute_x", "permute_y"), permute_x_with_permute_y),  # dW: both permutes
    ],
)
def test_each_rule_drops_exactly_its_config(cls, flags, rule):
    prune = PRUNE[cls]
    config = cls(**TILES, **dict.fromkeys(flags, True))
    assert [r for r in RULES[cls] if r(config)] == [rule]
    assert prune([config], BIG, supports_tma=True) == []
    for flag in flags:  # a neighbour with one offending flag off is kept
        neighbour = dataclasses.replace(config, **{flag: False})
        assert not any(r(neighbour) for r in RULES[cls])
        assert prune([neighbour], BIG, supports_tma=True) == [neighbour]


@pytest.mark.parametrize(
    "config",
    [
        KernelConfigForward(**TILES, use_tma_store=True, permute_x=True),  # store+permute_x is only a dX rule
        KernelConfigBackward_dX(**TILES, use_tma_store=True, permute_y=True),  # store+permute_y is only a fwd rule
        KernelConfigForward(**TILES, use_tma_load_w=True, permute_x=True),  # W is never permuted
        KernelConfigBackward_dX(**TILES, use_tma_load_w=True, permute_y=True),  # W is never permuted
        KernelConfigBackward_dW(**TILES, use_tma_store=True, permute_x=True),  # dW output is per expert
    ],
)
def test_rules_of_other_kernels_do_not_apply(config):
    assert PRUNE[type(config)]([config], BIG, supports_tma=True) == [config]


@pytest.mark.parametrize("cls", [KernelConfigForward, KernelConfigBackward_dX, KernelConfigBackward_dW])
def test_smem_rule(cls):
    config = cls(**TILES, use_tma_store=True)
    need = smem_bytes(config)
    exact = dataclasses.replace(BIG, SIZE_SMEM=need)
    tiny = dataclasses.replace(BIG, SIZE_SMEM=need - 1)
    assert not exceeds_smem(config, exact)  # boundary: exactly enough fits
    assert exceeds_smem(config, tiny)  # one byte short
    assert exceeds_smem(config, exact, element_size=4)  # fp32 doubles the need
    assert PRUNE[cls]([config], exact, supports_tma=True) == [config]
    assert PRUNE[cls]([config], tiny, supports_tma=True) == []


@pytest.mark.parametrize("cls", [KernelConfigForward, KernelConfigBackward_dX, KernelConfigBackward_dW])
def test_no_tma_support_drops_every_tma_flag(cls):
    load_a, load_b = [f.name for f in dataclasses.fields(cls) if f.name.startswith("use_tma_load_")]
    plain = cls(**TILES)
    with_tma = [cls(**TILES, **{name: True}) for name in (load_a, load_b, "use_tma_store")]
    assert not uses_tma(plain) and all(uses_tma(c) for c in with_tma)
    assert PRUNE[cls]([plain, *with_tma], BIG, supports_tma=False) == [plain]
    assert PRUNE[cls]([plain, *with_tma], BIG, supports_tma=True) == [plain, *with_tma]


def test_prune_rejects_another_kernels_config():
    with pytest.raises(TypeError, match="KernelConfigForward"):
        prune_kernel_configs_fwd([KernelConfigBackward_dX()], BIG)


# --- Search space. --------------------------------------------------------------------------------------------


def _violations(config, rules, props):
    return [r.__name__ for r in rules if r(config)] + (["smem"] if exceeds_smem(config, props) else [])


def test_get_kernel_configs_defaults():
    forward, dW, dX = get_kernel_configs()
    props = get_device_properties()
    for configs, cls in ((forward, KernelConfigForward), (dW, KernelConfigBackward_dW),
                         (dX, KernelConfigBackward_dX)):
        assert configs and all(type(c) is cls for c in configs)
        assert len(set(configs)) == len(configs)  # deduplicated
        assert all(c.flatten and not c.fuse_mul_post for c in configs)
        assert [c for c in configs if _violations(c, RULES[cls], props)] == []
        assert {c.permute_x for c in configs} == {True, False} and {c.permute_y for c in configs} == {True, False}
    assert get_kernel_configs() == (forward, dW, dX)  # deterministic order


SMALL = dict(BLOCK_M=[64], BLOCK_N=[64], BLOCK_K=[64], num_warps=[4], num_stages=[3])


@pytest.mark.parametrize(
    "overrides, smem, expected",
    [
        # 2^3 TMA combos x 4 permute combos = 32 each. Dropping both-permutes leaves 8 (neither) + 4 (permute_x:
        # one TMA flag forced off) + 4 (permute_y: one forced off) = 16 for every kernel.
        ({}, BIG.SIZE_SMEM, (16, 16, 16)),
        # fuse_permute=[False]: no permutes, so no rule fires: the 8 TMA combos.
        ({"fuse_permute": [False]}, BIG.SIZE_SMEM, (8, 8, 8)),
        # no TMA: 3 permute combos (neither, x only, y only).
        ({"use_tma_loads": [False]}, BIG.SIZE_SMEM, (3, 3, 3)),
        # duplicates in the value lists dedupe: still 16.
        ({"use_tma_loads": [True, False, True], "fuse_permute": [True, True]}, BIG.SIZE_SMEM, (16, 16, 16)),
        # 2 warps x BLOCK_M 64/128; at 60000 B every 128-row tile is over (fwd 73728+, dX 73728+, dW 98304+)
        # and every 64-row one fits (57344 with a TMA store): 2 x 16 = 32.
        ({"BLOCK_M": [64, 128], "num_warps": [4, 8]}, 60000, (32, 32, 32)),
        # at 50000 B the TMA store's out tile (49152 + 8192) is over, so use_tma_store is off too:
        # fwd 4 (neither) + 2 (x: load_x off) + 4 (y) = 10; dX 4 + 4 (x) + 2 (y: load_dy off) = 10;
        # dW 4 + 2 (x: load_x off) + 2 (y: load_dy off) = 8.
        ({}, 50000, (10, 8, 10)),
    ],
)
def test_get_kernel_configs_exact_counts(overrides, smem, expected):
    props = dataclasses.replace(BIG, SIZE_SMEM=smem)
    forward, dW, dX = get_kernel_configs(**{**SMALL, **overrides}, device_properties=props, supports_tma=True)
    assert (len(forward), len(dW), len(dX)) == expected
    for configs in (forward, dW, dX):
        assert len(set(configs)) == len(configs)


def test_get_kernel_configs_without_tma_support():
    for configs in get_kernel_configs(device_properties=BIG, supports_tma=False):
        assert configs and not any(uses_tma(c) for c in configs)


def test_get_kernel_configs_rejects_empty_lists():
    with pytest.raises(ValueError, match="BLOCK_N"):
        get_kernel_configs(BLOCK_N=[])


# --- Results. -------------------------------------------------------------------------------------------------


@pytest.fixture
def results():
    return [
        KernelResult(2.0, 1.0, KernelConfigForward(BLOCK_SIZE_M=64)),  # speedup 2.0
        KernelResult(1.0, 2.0, KernelConfigForward(BLOCK_SIZE_M=128)),  # speedup 0.5
        KernelResult(3.0, 1.0, KernelConfigForward(BLOCK_SIZE_M=256, use_tma_load_w=True)),  # speedup 3.0
    ]


def test_kernel_result_speedup_and_to_dict():
    config = KernelConfigBackward_dW(permute_x=True, use_tma_load_dy=True)
    result = KernelResult(torch_time=3.0, triton_time=1.5, kernel_config=config)
    assert result.speedup == 2.0
    row = result.to_dict()
    assert row == {**dataclasses.asdict(config), "kernel": "KernelConfigBackward_dW", "torch_time": 3.0,
                   "triton_time": 1.5, "speedup": 2.0}


@pytest.mark.parametrize("triton_time", [0.0, -1.0, math.nan])  # zero, negative, nan (no meaningful speedup)
def test_kernel_result_rejects_bad_triton_time(triton_time):
    with pytest.raises(ValueError, match="triton_time"):
        KernelResult(1.0, triton_time, KernelConfigForward())


@pytest.mark.parametrize(
    "sort_by, ascending, expected_m",
    [
        ("speedup", False, [256, 64, 128]),  # default: best speedup first
        ("speedup", True, [128, 64, 256]),  # worst first
        ("triton_time", True, [64, 256, 128]),  # tie at 1.0 keeps input order (stable sort)
    ],
)
def test_to_dataframe_sorting(results, sort_by, ascending, expected_m):
    frame = KernelResult.to_dataframe(results, sort_by=sort_by, ascending=ascending)
    assert frame["BLOCK_SIZE_M"].tolist() == expected_m
    assert list(frame.index) == [0, 1, 2]
    assert {"kernel", "torch_time", "triton_time", "speedup", "use_tma_load_w"} <= set(frame.columns)


def test_to_dataframe_bad_sort_by(results):
    with pytest.raises(ValueError, match="not_a_column"):
        KernelResult.to_dataframe(results, sort_by="not_a_column")


def test_to_dataframe_empty():
    frame = KernelResult.to_dataframe([])  # an empty result list still sorts by speedup
    assert frame.empty and "speedup" in frame.columns


def test_to_csv_round_trip(results, tmp_path):
    path = KernelResult.to_csv(results, filename=tmp_path / "sub" / "results.csv")
    assert path == tmp_path / "sub" / "results.csv"
    read = pd.read_csv(path)
    expected = KernelResult.to_dataframe(results)
    assert list(read.columns) == list(expected.columns)
    pd.testing.assert_frame_equal(read, expected, check_dtype=False)
    configs = [KernelConfigForward.from_dict({k: v for k, v in row.items() if k in expected.columns[1:-3]})
               for row in read.to_dict("records")]
    assert configs == [r.kernel_config for r in sorted(results, key=lambda r: -r.speedup)]


@pytest.mark.parametrize("num_results", [0, 2, 3, 10])  # none, fewer than, equal to, more than the results
def test_print_table(results, capsys, num_results):
    text = KernelResult.print_table(results, num_results=num_results)
    assert capsys.readouterr().out == text + "\n"
    lines = text.splitlines()
    assert lines[0].split() == ["kernel_config", "torch_time", "triton_time", "speedup"]
    rows = lines[1:]
    assert len(rows) == min(num_results, len(results))
    if rows:  # best speedup first, labelled with tuning params and TMA flags
        assert rows[0].startswith(results[2].kernel_config.to_string(include_tuning_params=True, include_tma=True))
        assert rows[0].split()[-3:] == ["3.0000", "1.0000", "3.000"]


# --- Failures in a tuning loop. -------------------------------------------------------------------------------


def test_check_resources():
    config = KernelConfigForward(**TILES)
    check_resources(config, dataclasses.replace(BIG, SIZE_SMEM=smem_bytes(config)))  # fits: no error
    with pytest.raises(OutOfResources) as info:
        check_resources(config, dataclasses.replace(BIG, SIZE_SMEM=1024))
    assert (info.value.required, info.value.limit, info.value.name) == (smem_bytes(config), 1024, "shared memory")


def test_context_out_of_resources(caplog):
    config = KernelConfigBackward_dX(**TILES, permute_x=True)
    with caplog.at_level(logging.WARNING), TritonTuningContext(config) as ctx:
        check_resources(config, dataclasses.replace(BIG, SIZE_SMEM=1000))
        pytest.fail("check_resources should have raised")
    assert ctx.success is False and ctx.kernel_config is config
    assert "shared memory" in ctx.error and str(smem_bytes(config)) in ctx.error and "1000" in ctx.error
    assert config.to_string(include_tuning_params=True, include_tma=True) in ctx.error
    assert "\n" not in ctx.error
    assert ctx.error in caplog.text


def test_context_other_exception():
    config = KernelConfigForward(**TILES, use_tma_load_w=True)
    with TritonTuningContext(config) as ctx:
        raise ValueError("bad\nvalue")
    assert ctx.success is False
    assert config.to_string(include_tuning_params=True, include_tma=True) in ctx.error
    assert "ValueError" in ctx.error and "bad value" in ctx.error and "\n" not in ctx.error


def test_context_success():
    with TritonTuningContext(KernelConfigForward()) as ctx:
        pass
    assert ctx.success is True and ctx.error is None


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])  # BaseExceptions that are not Exceptions
def test_context_lets_interrupts_through(exc):
    with pytest.raises(exc), TritonTuningContext(KernelConfigForward()) as ctx:
        raise exc()
    assert ctx.success is True and ctx.error is None
