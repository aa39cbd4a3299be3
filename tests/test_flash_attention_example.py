"""examples/flash_attention.py: the kernel against the fp32 reference (fp16/fp32, causal or not, N_CTX not a multiple
of the blocks), the flash_attention() helper with non-contiguous inputs, the cost model, and main() on the CPU."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

from tritune.tuning.check import check_output
from tritune.tuning.types import Config

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
sys.path.insert(0, str(EXAMPLES))  # the example is a script, not a package: workers import it the same way
import flash_attention as fa  # noqa: E402

# Where kernels run: the GPU when there is one, else the CPU through the interpreter (conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _children_can_import(monkeypatch, tmp_path):
    # Spawned benchmark workers import tritune and the example (the tuned kernel is pickled by reference).
    paths = [str(HERE.parent / "src"), str(EXAMPLES), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path))  # never read or write ./tritune_tuned
    fa.attention.reload()


def problem(n_ctx: int, head_dim: int, causal: bool, dtype: str, z: int = 1, h: int = 2) -> dict:
    return dict(Z=z, H=h, N_CTX=n_ctx, HEAD_DIM=head_dim, CAUSAL=causal, dtype=dtype)


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_ctx, head_dim, block_m, block_n", [
    (33, 16, 16, 16),  # N_CTX one past a block: a last tile of one row
    (50, 32, 32, 16),  # BLOCK_SIZE_M > BLOCK_SIZE_N: causal tiles end mid-block
    (50, 16, 16, 32),  # BLOCK_SIZE_N > BLOCK_SIZE_M: masked keys inside the first block
    (64, 16, 32, 32),  # exact multiple: no edge
])
def test_kernel_matches_reference(dtype, causal, n_ctx, head_dim, block_m, block_n):
    p = problem(n_ctx, head_dim, causal, dtype)
    args = fa.attention.make_args(p, DEVICE, seed=0)
    config = Config.of(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, num_warps=4, num_stages=2)
    assert fa.attention.grid_for(args, config) == (-(-n_ctx // block_m), 2, 1)
    fa.attention.launch(args, config)
    result = check_output(args["Out"], fa.attention_reference(args), fa.attention.tolerance_for(args))
    assert result.passed, result.reason


def test_flash_attention_helper_on_strided_inputs():
    torch.manual_seed(0)
    # [Z, N_CTX, H, D] storage seen as [Z, H, N_CTX, D]: strides the kernel must follow.
    q, k, v = (torch.randn(2, 40, 2, 32, dtype=torch.float16, device=DEVICE).transpose(1, 2) for _ in range(3))
    out = fa.flash_attention(q, k, v, causal=True, sm_scale=0.2)
    ref = fa.attention_reference(fa.attention_args(q, k, v, out, True, 0.2))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="power of two"):
        fa.flash_attention(*(torch.randn(1, 1, 8, 24, device=DEVICE) for _ in range(3)), causal=False)


def test_key_space_and_cost_model():
    args = fa.attention.make_args(problem(50, 16, True, "fp16"), "meta")
    assert fa.attention.key_text(args) == \
        "Z=1,H=2,N_CTX=50,HEAD_DIM=16,CAUSAL=True,Q=float16,K=float16,V=float16,Out=float16"
    big = fa.attention.make_args(problem(1024, 128, False, "bf16", z=4, h=16), "meta")
    kept = fa.attention.configs(big)
    # 36 configs; BLOCK_SIZE_N > BLOCK_SIZE_M removes BM=64,BN=128 (2 warps x 3 stages), 128x128 on 4 warps 3 more.
    assert (len(kept), fa.attention.search_space(big).prune().pruned) == (27, {
        "BLOCK_SIZE_N > BLOCK_SIZE_M": 6, "128x128 score tile on 4 warps": 3})
    assert fa.attention_flops(dict(Z=4, H=16, N_CTX=1024, HEAD_DIM=64, CAUSAL=False)) == 4 * 4 * 16 * 1024**2 * 64
    assert fa.attention_flops(dict(Z=4, H=16, N_CTX=1024, HEAD_DIM=64, CAUSAL=True)) == 2 * 4 * 16 * 1024**2 * 64
    assert pickle.loads(pickle.dumps(fa.attention)) is fa.attention
    assert fa.attention.kernel is fa._attn_fwd


def test_main_tunes_then_reuses_on_the_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("main() tunes 24 full-size shapes on a GPU")
    store = tmp_path / "fa.json"
    try:
        assert fa.main(["--store", str(store)]) == 0
    finally:
        fa.attention.store_path = None  # main() pointed the module's kernel at --store
    text = capsys.readouterr().out
    assert "interpreter: correctness only, timings meaningless" in text
    first, second = text.split("second run")
    assert "tuned: 3 measured, 0 failed" in first and "store (reused)" in second
    assert store.is_file() and (tmp_path / "flash_attention.journal.sqlite").is_file()
