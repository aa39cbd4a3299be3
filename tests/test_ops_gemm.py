"""ops.gemm config lookup: the shape file (exact M, else the off-grid cost estimate), else the rule-table heuristic
(never the voted device default); cached until reload_configs()."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune import knobs
from tritune.device import current_device
from tritune.kernels import gemm as gk
from tritune.ops.gemm import gemm, heuristic_config, reload_configs, select_config
from tritune.store import gemm_json
from tritune.store.gemm_json import GemmEntry, write_default_file, write_shape_file
from tritune.tuning.types import Config

DEVICE = current_device()  # slug "cpu_interpreter" without a GPU
TORCH_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Recognisable configs, both small enough for the interpreter.
SHAPE_CFG = gk.GemmConfig(BLOCK_SIZE_M=32, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4,
                          num_stages=2)
DEFAULT_CFG = gk.GemmConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=16, GROUP_SIZE_M=1, num_warps=4,
                            num_stages=2)
OTHER_CFG = dataclasses.replace(SHAPE_CFG, BLOCK_SIZE_N=16)


def entry(M: int, cfg: gk.GemmConfig) -> GemmEntry:
    return GemmEntry(M=M, config=Config.from_dict(dataclasses.asdict(cfg)), time_us=5.0, tflops=1.0, gbps=1.0,
                     error=0.0)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(knobs.CONFIG_DIR, str(tmp_path / "user"))
    (tmp_path / "user").mkdir()
    # An empty "shipped" folder, so configs shipped for this GPU cannot stand in for the heuristic.
    monkeypatch.setattr(gemm_json, "PACKAGE_DIR", tmp_path / "shipped")
    reload_configs()
    yield tmp_path / "user"
    reload_configs()  # later tests must not see this folder's files (monkeypatch restores the variable after)


def write_files(folder) -> tuple:
    """Default file voted from (64, 64) alone, then the (40, 48) shape file: the two hold different configs."""
    prov = DEVICE.provenance()
    write_shape_file(folder, prov, "BF16", 64, 64, {17: entry(17, DEFAULT_CFG)}, device_slug=DEVICE.slug)
    default = write_default_file(folder, prov, "BF16", device_slug=DEVICE.slug)
    shape = write_shape_file(folder, prov, "BF16", 40, 48, {17: entry(17, SHAPE_CFG)}, device_slug=DEVICE.slug)
    return shape, default


@pytest.mark.parametrize(("M", "where"), [
    (17, "tuned M=17"),  # the tuned M itself
    (5, "off-grid: M=5"),  # untuned M: chosen among the tuned configs (and the rule table's) by the cost model
    (1000, "off-grid: M=1000"),  # far above the only tuned M
])
def test_shape_file_first(M, where, config_dir):
    shape, _ = write_files(config_dir)
    cfg, source = select_config("bf16", M, 40, 48, TORCH_DEVICE)
    assert source.startswith(f"shape file {shape}: {where}")
    assert cfg in (SHAPE_CFG, heuristic_config("bf16", M, 40, 48, DEVICE.sm_count))
    if M == 17:
        assert cfg == SHAPE_CFG


def test_offgrid_choice_between_two_tuned_m(config_dir):
    # The config tuned at M=64 is scaled to M=48 and wins over M=16's, which the model says wastes waves there.
    small, large = dataclasses.replace(SHAPE_CFG, BLOCK_SIZE_M=16), dataclasses.replace(SHAPE_CFG, BLOCK_SIZE_M=64)
    write_shape_file(config_dir, DEVICE.provenance(), "BF16", 4096, 4096,
                     {16: dataclasses.replace(entry(16, small), time_us=20.0),
                      64: dataclasses.replace(entry(64, large), time_us=21.0)}, device_slug=DEVICE.slug)
    cfg, source = select_config("bf16", 48, 4096, 4096, TORCH_DEVICE)
    assert "off-grid: M=48 between tuned 16 and 64" in source
    assert cfg in (small, large, heuristic_config("bf16", 48, 4096, 4096, DEVICE.sm_count))


def test_rule_table_not_the_device_default_for_an_untuned_shape(config_dir):
    write_files(config_dir)  # a default file exists, voted from another shape
    for M in (17, 300):
        cfg, source = select_config("bf16", M, 80, 96, TORCH_DEVICE)
        assert source == "heuristic"
        assert cfg == heuristic_config("bf16", M, 80, 96, DEVICE.sm_count) and cfg != DEFAULT_CFG


def test_heuristic_without_files(config_dir):
    for M, N, K in ((1, 40, 48), (100, 4096, 4096), (4096, 4096, 4096)):  # three heuristic rows
        cfg, source = select_config("bf16", M, N, K, TORCH_DEVICE)
        assert source == "heuristic"
        assert cfg == heuristic_config("bf16", M, N, K, DEVICE.sm_count)


def test_choices_cached_until_reload(config_dir):
    assert select_config("bf16", 17, 40, 48, TORCH_DEVICE)[1] == "heuristic"
    shape, _ = write_files(config_dir)
    assert select_config("bf16", 17, 40, 48, TORCH_DEVICE)[1] == "heuristic"  # files written after the first look
    reload_configs()
    assert select_config("bf16", 17, 40, 48, TORCH_DEVICE) == (SHAPE_CFG, f"shape file {shape}: tuned M=17")
    write_shape_file(config_dir, DEVICE.provenance(), "BF16", 40, 48, {17: entry(17, OTHER_CFG)},
                     device_slug=DEVICE.slug)  # a retune replaces M=17
    assert select_config("bf16", 17, 40, 48, TORCH_DEVICE)[0] == SHAPE_CFG
    reload_configs()
    assert select_config("bf16", 17, 40, 48, TORCH_DEVICE)[0] == OTHER_CFG


def test_select_config_takes_a_device_name_and_refuses_an_output_dtype_the_ops_refuse(config_dir):
    shape, _ = write_files(config_dir)
    assert select_config("bf16", 17, 40, 48, str(TORCH_DEVICE)) == (SHAPE_CFG, f"shape file {shape}: tuned M=17")
    # "fp16" (a string) once answered quietly with the bf16 files; gemm(out_dtype="fp16") raises this same error.
    for bad in ("fp16", torch.float32):
        with pytest.raises(ValueError, match="out_dtype must be torch.bfloat16 or torch.float16"):
            select_config("bf16", 17, 40, 48, TORCH_DEVICE, out_dtype=bad)


@pytest.mark.parametrize(("M", "N", "K"), [
    (17, 40, 48),  # shape file; M, N, K all off the 32-wide blocks (masked edges)
    (3, 80, 96),  # no shape file: the rule table; M far under BLOCK_SIZE_M
])
def test_gemm_op_uses_the_looked_up_config_and_is_correct(M, N, K, config_dir, monkeypatch):
    write_files(config_dir)
    used = []
    real = gk.GemmLaunch

    def spy(kernel, a, b, a_scale, b_scale, out, cfg):
        used.append(cfg)
        return real(kernel, a, b, a_scale, b_scale, out, cfg)

    monkeypatch.setattr(gk, "GemmLaunch", spy)
    gen = torch.Generator().manual_seed(0)
    # fp16 operands: the interpreter's tl.dot is wrong on bf16 ones. B / sqrt(K) keeps C ~ N(0, 1).
    a = torch.randn(M, K, generator=gen).to(TORCH_DEVICE, torch.float16)
    b = (torch.randn(N, K, generator=gen) / K**0.5).to(TORCH_DEVICE, torch.float16)
    out = gemm(a, b)
    assert used == [select_config("bf16", M, N, K, TORCH_DEVICE)[0]]
    assert used[0] in (SHAPE_CFG, heuristic_config("bf16", M, N, K, DEVICE.sm_count))
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    torch.testing.assert_close(out.float(), gk.gemm_reference("bf16", a, b), atol=1e-2, rtol=1e-2)


def test_fp16_output_reads_the_fp16_tunes_only(config_dir, monkeypatch):
    """An fp16 C (out_dtype or an fp16 `out`) is served by the -OUT_FP16 shape file, a bf16 C by the bf16 one."""
    prov, M, N, K = DEVICE.provenance(), 17, 40, 48
    bf16 = write_shape_file(config_dir, prov, "BF16", N, K, {M: entry(M, SHAPE_CFG)}, device_slug=DEVICE.slug)
    fp16 = write_shape_file(config_dir, prov, "BF16", N, K, {M: entry(M, OTHER_CFG)}, device_slug=DEVICE.slug,
                            out_dtype="fp16")
    assert fp16.name.endswith("-GEMM-BF16-OUT_FP16-N=40-K=48.json")
    assert select_config("bf16", M, N, K, TORCH_DEVICE) == (SHAPE_CFG, f"shape file {bf16}: tuned M={M}")
    assert select_config("bf16", M, N, K, TORCH_DEVICE, torch.float16) == (OTHER_CFG, f"shape file {fp16}: tuned M={M}")
    used = []
    real = gk.GemmLaunch

    def spy(kernel, a, b, a_scale, b_scale, out, cfg):
        used.append((out.dtype, cfg))
        return real(kernel, a, b, a_scale, b_scale, out, cfg)

    monkeypatch.setattr(gk, "GemmLaunch", spy)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(M, K, generator=gen).to(TORCH_DEVICE, torch.float16)  # fp16 operands: see the test above
    b = (torch.randn(N, K, generator=gen) / K**0.5).to(TORCH_DEVICE, torch.float16)
    ref = gk.gemm_reference("bf16", a, b)
    out = gemm(a, b, out_dtype=torch.float16)
    assert out.dtype == torch.float16 and used == [(torch.float16, OTHER_CFG)]
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    given = torch.empty(M, N, device=TORCH_DEVICE, dtype=torch.float16)
    assert gemm(a, b, out=given) is given and used[-1] == (torch.float16, OTHER_CFG)  # an fp16 `out` alike
    assert gemm(a, b).dtype == torch.bfloat16 and used[-1] == (torch.bfloat16, SHAPE_CFG)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(out_dtype=torch.float32), "out_dtype must be torch.bfloat16 or torch.float16"),
    (dict(out=torch.empty(4, 8, dtype=torch.bfloat16), out_dtype=torch.float16), "out is torch.bfloat16 but"),
])
def test_out_dtype_errors(kwargs, message, config_dir):
    a, b = torch.zeros(4, 16, dtype=torch.float16), torch.zeros(8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=message):
        gemm(a, b, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                    reason="on Hopper the Gluon kernel itself runs (tests/test_gluon_blockscale_gpu.py)")
@pytest.mark.parametrize("cfg", [
    gk.GemmConfig(64, 128, 128, 8, 4, 2, PERSISTENT_TMA=True, GLUON=True),
    # the warp-specialised kernel with K split: its split is the Gluon kernel's, dropped with it
    gk.GemmConfig(128, 128, 128, 8, 8, 2, NUM_KSPLIT=2, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True)],
    ids=["64x128", "ws-split2"])
def test_a_gluon_config_runs_the_triton_kernel_where_gluon_cannot(monkeypatch, cfg):
    """A block-scaled file tuned on Hopper names GLUON; read on another GPU (or the interpreter) the op drops it and
    runs the same tile on the Triton kernel, unsplit, with the reference's result."""
    from tritune.kernels.quant import quantize_blocks
    from tritune.ops import gemm_a8w8_blockscale

    used = []
    real = gk.GemmLaunch
    monkeypatch.setattr(gk, "GemmLaunch", lambda *args: used.append(args[-1]) or real(*args))
    gen = torch.Generator().manual_seed(1)
    (qa, sa), (qb, sb) = quantize_blocks(torch.randn(40, 256, generator=gen), 1), \
        quantize_blocks(torch.randn(72, 256, generator=gen) / 16, 128)
    ops = [t.to(TORCH_DEVICE) for t in (qa, qb, sa, sb)]
    out = gemm_a8w8_blockscale(*ops, config=cfg)
    assert len(used) == 1 and not used[0].GLUON and used[0].BLOCK_SIZE_M == cfg.BLOCK_SIZE_M
    assert used[0].NUM_KSPLIT == 1 and not used[0].WARP_SPECIALIZE
    ref = gk.gemm_reference("a8w8_blockscale", *ops)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                    reason="on Hopper the Gluon kernel itself runs (tests/test_gluon_gemm_gpu.py)")
@pytest.mark.parametrize(("block_n", "triton_n"), [(192, 128), (96, 64), (128, 128)])
def test_a_gluon_per_token_config_runs_a_triton_tile_where_gluon_cannot(monkeypatch, block_n, triton_n):
    """An a8w8 file tuned on Hopper may name a Gluon tile two powers of two wide; where Gluon cannot run the op takes
    the larger power of two on the Triton kernel (it has no 192-wide tile), with the reference's result."""
    from tritune.kernels.quant import quantize_rows
    from tritune.ops import gemm_a8w8

    used = []
    real = gk.GemmLaunch
    monkeypatch.setattr(gk, "GemmLaunch", lambda *args: used.append(args[-1]) or real(*args))
    gen = torch.Generator().manual_seed(2)
    (qa, sa), (qb, sb) = quantize_rows(torch.randn(40, 256, generator=gen)), \
        quantize_rows(torch.randn(200, 256, generator=gen) / 16)
    ops = [t.to(TORCH_DEVICE) for t in (qa, qb, sa, sb)]
    cfg = gk.GemmConfig(64, block_n, 128, 8, 4, 3, PERSISTENT_TMA=True, GLUON=True)
    out = gemm_a8w8(*ops, config=cfg)
    assert len(used) == 1 and not used[0].GLUON and (used[0].BLOCK_SIZE_M, used[0].BLOCK_SIZE_N) == (64, triton_n)
    ref = gk.gemm_reference("a8w8", *ops)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
