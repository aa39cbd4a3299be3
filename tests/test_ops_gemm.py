"""ops.gemm config lookup: shape file, then device default, then the heuristic; cached until reload_configs()."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune import knobs
from tritune.kernels import gemm as gk
from tritune.ops.gemm import gemm, heuristic_config, reload_configs, select_config
from tritune.store import gemm_json
from tritune.store.gemm_json import GemmEntry, write_default_file, write_shape_file
from tritune.tuning.device import current_device
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
    (17, "M=17"),  # the tuned M itself
    (5, "bucket small"),  # untuned M in a tuned bucket
    (1000, "bucket any"),  # xlarge: not tuned, falls to "any"
])
def test_shape_file_first(M, where, config_dir):
    shape, _ = write_files(config_dir)
    cfg, source = select_config("bf16", M, 40, 48, TORCH_DEVICE)
    assert cfg == SHAPE_CFG
    assert source == f"shape file {shape} {where}"


def test_device_default_for_an_untuned_shape(config_dir):
    _, default = write_files(config_dir)
    for M, bucket in ((17, "small"), (300, "any")):  # a bucket the default has, and one only "any" covers
        cfg, source = select_config("bf16", M, 80, 96, TORCH_DEVICE)
        assert cfg == DEFAULT_CFG
        assert source == f"device default {default} bucket {bucket}"


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
    assert select_config("bf16", 17, 40, 48, TORCH_DEVICE) == (SHAPE_CFG, f"shape file {shape} M=17")
    write_shape_file(config_dir, DEVICE.provenance(), "BF16", 40, 48, {17: entry(17, OTHER_CFG)},
                     device_slug=DEVICE.slug)  # a retune replaces M=17
    assert select_config("bf16", 17, 40, 48, TORCH_DEVICE)[0] == SHAPE_CFG
    reload_configs()
    assert select_config("bf16", 17, 40, 48, TORCH_DEVICE)[0] == OTHER_CFG


@pytest.mark.parametrize(("M", "N", "K"), [
    (17, 40, 48),  # shape file; M, N, K all off the 32-wide blocks (masked edges)
    (3, 80, 96),  # device default; M far under BLOCK_SIZE_M
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
    assert used[0] in (SHAPE_CFG, DEFAULT_CFG)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    torch.testing.assert_close(out.float(), gk.gemm_reference("bf16", a, b), atol=1e-2, rtol=1e-2)
