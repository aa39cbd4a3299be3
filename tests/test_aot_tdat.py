"""The .tdat tensor file (tritune.aot.tdat): round trips, metadata, and every malformed-file error."""

import os

import pytest
import torch

from tritune.aot.tdat import (
    MAGIC,
    MAX_HEADER_BYTES,
    TDAT_DTYPES,
    TdatError,
    first_element,
    read_header,
    read_tensor,
    write_tensor,
)


def _random(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    hi = 256 if dtype == torch.uint8 else 1 << 20
    lo = 0 if dtype == torch.uint8 else -hi
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype_name", list(TDAT_DTYPES))
@pytest.mark.parametrize(
    "shape",
    [
        (3, 5),  # plain 2-d
        (7,),  # 1-d, odd length (no padding in the payload)
        (),  # 0-d scalar: empty shape line
        (0,),  # empty 1-d
        (2, 0, 3),  # empty with a zero in the middle
        (2, 3, 4, 1),  # trailing unit dim
    ],
)
def test_round_trip_every_dtype_and_shape(tmp_path, dtype_name, shape):
    dtype = TDAT_DTYPES[dtype_name]
    tensor = _random(shape, dtype, seed=len(shape))
    path = tmp_path / f"x.{dtype_name}.tdat"
    write_tensor(path, "x", tensor)
    header, back = read_tensor(path)
    assert header.name == "x"
    assert header.dtype == dtype_name
    assert header.shape == shape
    assert header.meta == {}
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back, tensor)
    expected_bytes = tensor.numel() * dtype.itemsize
    assert os.path.getsize(path) == header.data_offset + expected_bytes
    assert read_header(path) == header


def test_bf16_bits_survive_exactly(tmp_path):
    # Every bf16 bit pattern, NaNs and infinities included, comes back bit for bit.
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    tensor = bits.view(torch.bfloat16)
    write_tensor(tmp_path / "all.tdat", "all", tensor)
    _, back = read_tensor(tmp_path / "all.tdat")
    assert torch.equal(back.view(torch.int16), bits)


def test_writes_any_layout_and_the_exact_text_header(tmp_path):
    base = _random((4, 6), torch.float32)
    view = base.t()[1:3]  # non-contiguous, offset view
    write_tensor(tmp_path / "v.tdat", "sorted_token_ids", view, meta={"block_size_m": 64})
    raw = (tmp_path / "v.tdat").read_bytes()
    text = b"TRITUNE-TENSOR 1\nname: sorted_token_ids\ndtype: fp32\nshape: 2 4\nblock_size_m: 64\nend\n"
    assert raw.startswith(text)
    assert len(raw) == len(text) + 2 * 4 * 4
    _, back = read_tensor(tmp_path / "v.tdat")
    assert torch.equal(back, view)


def test_zero_d_header_has_an_empty_shape_line(tmp_path):
    write_tensor(tmp_path / "s.tdat", "s", torch.tensor(7, dtype=torch.int64))
    assert b"\nshape:\n" in (tmp_path / "s.tdat").read_bytes()
    assert first_element(tmp_path / "s.tdat") == 7


def test_metadata_round_trips_as_text(tmp_path):
    meta = {"block_size_m": 64, "problem": "T=1024-E=8-topk=2", "note": "  two leading spaces", "empty": ""}
    write_tensor(tmp_path / "m.tdat", "m", torch.zeros(2, dtype=torch.int32), meta=meta)
    header = read_header(tmp_path / "m.tdat")
    assert header.meta == {key: str(value) for key, value in meta.items()}
    assert list(header.meta) == list(meta)  # order kept


@pytest.mark.parametrize(
    "meta, match",
    [
        ({"Bad": 1}, "must match"),  # upper case key
        ({"shape": "1"}, "reserved"),
        ({"k": "a\nb"}, "newline"),
        ({"k": 1.5}, "str or an int"),
        ({"k": True}, "str or an int"),
    ],
)
def test_bad_metadata_is_refused_before_writing(tmp_path, meta, match):
    with pytest.raises(TdatError, match=match):
        write_tensor(tmp_path / "m.tdat", "m", torch.zeros(1), meta=meta)
    assert list(tmp_path.iterdir()) == []


def test_unsupported_dtype_names_the_file(tmp_path):
    with pytest.raises(TdatError, match=r"d\.tdat.*float64"):
        write_tensor(tmp_path / "d.tdat", "d", torch.zeros(2, dtype=torch.float64))


def test_first_element_of_integer_files(tmp_path):
    write_tensor(tmp_path / "i32.tdat", "n", torch.tensor([-5, 9], dtype=torch.int32))
    write_tensor(tmp_path / "i64.tdat", "n", torch.tensor([1 << 40], dtype=torch.int64))
    assert first_element(tmp_path / "i32.tdat") == -5
    assert first_element(tmp_path / "i64.tdat") == 1 << 40
    write_tensor(tmp_path / "f.tdat", "f", torch.ones(2))
    with pytest.raises(TdatError, match=r"f\.tdat.*fp32"):
        first_element(tmp_path / "f.tdat")
    write_tensor(tmp_path / "e.tdat", "e", torch.zeros(0, dtype=torch.int32))
    with pytest.raises(TdatError, match=r"e\.tdat.*empty"):
        first_element(tmp_path / "e.tdat")


def test_atomic_write_leaves_no_temp_files_and_replaces(tmp_path):
    path = tmp_path / "sub" / "x.tdat"  # parent folder is created
    write_tensor(path, "x", torch.zeros(3))
    write_tensor(path, "x", torch.ones(5))
    assert [p.name for p in path.parent.iterdir()] == ["x.tdat"]
    assert torch.equal(read_tensor(path)[1], torch.ones(5))


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.tdat"
    write_tensor(path, "x", torch.zeros(3))

    def broken_replace(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        write_tensor(path, "x", torch.ones(3))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["x.tdat"]
    assert torch.equal(read_tensor(path)[1], torch.zeros(3))


GOOD = b"TRITUNE-TENSOR 1\nname: t\ndtype: int32\nshape: 2\nend\n" + b"\x01\x00\x00\x00\x02\x00\x00\x00"


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"", "bad magic"),
        (b"PK\x03\x04 not a tensor at all", "bad magic"),
        (b"TRITUNE-TENSOR 2\nname: t\n", "unsupported version"),
        (GOOD.replace(b"end\n", b""), "ends before its 'end' line"),
        (GOOD.replace(b"name: t\n", b""), "lacks required key.*name"),
        (GOOD.replace(b"dtype: int32\n", b""), "lacks required key.*dtype"),
        (GOOD.replace(b"shape: 2\n", b""), "lacks required key.*shape"),
        (GOOD.replace(b"int32", b"fp64"), "line 3: unknown dtype 'fp64'"),
        (GOOD.replace(b"shape: 2", b"shape: 2 -1"), "line 4: bad shape"),
        (GOOD.replace(b"shape: 2", b"shape: 2x"), "line 4: bad shape"),
        (GOOD.replace(b"name: t\n", b"name: t\nname: u\n"), "line 3: key 'name' repeated"),
        (GOOD.replace(b"name: t\n", b"Name: t\n"), "line 2: want 'key: value'"),
        (GOOD.replace(b"name: t\n", b"no colon here\n"), "line 2: want 'key: value'"),
        (GOOD[:-1], r"payload too short: 7 bytes, expected 8"),
        (GOOD + b"\x00", r"payload too long: 9 bytes, expected 8"),
        (GOOD.replace(b"shape: 2", b"shape: 3"), r"payload too short: 8 bytes, expected 12"),
        (MAGIC + b"name: " + b"x" * MAX_HEADER_BYTES, "header longer than"),
    ],
)
def test_malformed_files_name_the_file_and_the_problem(tmp_path, raw, match):
    path = tmp_path / "bad.tdat"
    path.write_bytes(raw)
    for read in (read_header, read_tensor):
        with pytest.raises(TdatError, match=match) as info:
            read(path)
        message = str(info.value)
        assert message.startswith(str(path) + ": ")
        assert "\n" not in message


def test_good_reference_bytes_read(tmp_path):
    path = tmp_path / "good.tdat"
    path.write_bytes(GOOD)
    header, tensor = read_tensor(path)
    assert header.shape == (2,) and tensor.tolist() == [1, 2]
    assert header.data_offset == len(GOOD) - 8


def test_missing_file_names_it(tmp_path):
    with pytest.raises(TdatError, match=r"nope\.tdat: no such file"):
        read_header(tmp_path / "nope.tdat")
