"""Progress lines name a problem by a short label (the journal keeps the full key): fused-MoE and grouped-GEMM
problems have their own, any other key is cut in the middle."""

from __future__ import annotations

from dataclasses import dataclass

from tritune.kernels.fused_moe import MoeConfig
from tritune.store.fmoe_rows import FmoeShape
from tritune.tuners.fused_moe_tunable import MoeProblem
from tritune.tuners.grouped_gemm_tunable import GroupedGemmProblem, GroupedGemmShape
from tritune.tuning.report import PROGRESS_LABEL_CHARS, progress_label

# DeepSeek-V3's MoE: the longest dimensions and quant name a row has in practice.
SHAPE = FmoeShape(16384, 7168, 2048, 256, 8, "silu", "bf16", "fp8", "fp8", "per_1x128", True, False)
BIG = MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=8, num_stages=4)


def test_moe_labels_are_short_and_name_the_row_and_kind():
    e2e = MoeProblem(SHAPE, "e2e", 1.2, (BIG, BIG))
    assert len(e2e.key()) > 150  # the journal's key carries both kernel names
    assert progress_label(e2e) == "moe e2e BM128 T16384 D7168 I2048 E256 k8 silu bf16 per_1x128 zipf1.2"
    assert progress_label(MoeProblem(SHAPE, "stage1")) == "moe stage1 T16384 D7168 I2048 E256 k8 silu bf16 per_1x128"
    assert all(len(progress_label(MoeProblem(SHAPE, kind, 1.2, (BIG, BIG) if kind == "e2e" else None)))
               <= PROGRESS_LABEL_CHARS for kind in ("stage1", "stage2", "1stage", "e2e"))


def test_grouped_gemm_label():
    shape = GroupedGemmShape(128, 2048, 768, 8, 8192, "bf16", 1.2)
    assert progress_label(GroupedGemmProblem(shape, "gate_up", "dW")) == "gate_up dW T8192 E128 k8"


@dataclass(frozen=True)
class LongKey:
    """A problem without a label, whose key is longer than a progress line should carry."""

    def key(self) -> str:
        return "head:" + "x" * 200 + ":tail"


def test_a_long_key_without_label_is_cut_in_the_middle():
    label = progress_label(LongKey())
    assert len(label) == PROGRESS_LABEL_CHARS and label.startswith("head:x") and label.endswith("x:tail")
    assert "…" in label
