"""benchmarks/probe_decode_floor.py: its streaming readers touch every routed word once (checked by XOR, in the
interpreter on odd sizes), and it refuses to run without a GPU (it times)."""

from __future__ import annotations

import pytest
import torch
from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("probe_decode_floor")


def test_xor_rows_is_the_xor_of_every_row(probe):
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(-2**31, 2**31 - 1, (7, 5), dtype=torch.int32, generator=gen)
    want = rows[0].clone()
    for r in rows[1:]:
        want ^= r
    assert torch.equal(probe.xor_rows(rows), want)


@pytest.mark.parametrize("programs", [None, 3, 64], ids=["a program a chunk", "persistent", "more than chunks"])
def test_the_stream_reads_each_routed_word_once(probe, programs):
    gen = torch.Generator().manual_seed(2)
    buf = torch.randint(-2**31, 2**31 - 1, (6, 3000 + 7), dtype=torch.int32, generator=gen)  # a partial chunk
    ids = torch.tensor([4, 1, 5], dtype=torch.int32)
    stream = probe.Stream(buf, ids, 512, programs, 4)
    assert stream.check()
    routed = probe.xor_rows(stream.out.view(stream.grid, stream.block))
    other = probe.Stream(buf, torch.tensor([4, 1, 2], dtype=torch.int32), 512, programs, 4)
    other()  # another expert routed: another checksum (the kernel follows the ids)
    assert not torch.equal(probe.xor_rows(other.out.view(other.grid, other.block)), routed)


@pytest.mark.parametrize("atom", [1, 4, 16])
def test_the_tile_reader_covers_each_row_word_once_whatever_the_atom(probe, atom):
    gen = torch.Generator().manual_seed(3)
    buf = torch.randint(-2**31, 2**31 - 1, (5, 96 * 45 + 3), dtype=torch.int32, generator=gen)
    ids = torch.tensor([0, 3], dtype=torch.int32)
    for programs in (2, 100):
        t = probe.TileStream(buf, ids, 96, 45, 16, 8, programs, atom)  # 45 words a row cut to 40: 5 steps of 8
        assert t.row_words == 40 and t.check()


def test_it_needs_a_gpu(probe):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    with pytest.raises(SystemExit, match="needs a GPU"):
        probe.main(["--tokens", "1"])
