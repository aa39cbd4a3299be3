"""MXFP4 weight bytes re-encoded once so the swapped GEMM's bf16 decode costs 12 instructions per 8 weights, not 18.

Why: the e2m1 -> bf16 decode was half of the swapped stage kernels' K step (288 of 601 SASS instructions in the
gated stage 1, sm90). With the standard nibble order every output register needs a byte permute, a multiply that
copies the nibble into place, and a mask. Re-encoded, the bits each output register wants already sit at the bf16
positions, or one rotation away. Measured on the H100 (gpt-oss-120b, nineteenth session): stage 1's K loop 601 ->
505 instructions, the stage pair 1-2% faster at 16-256 tokens (not issue-bound there) and 3.5-8% at 1024-4096.

A group is the 4 bytes one decode instance holds in the wgmma fragment's register order: rows r and r + 8 of each
16 (r < 8) times one byte pair along K, bytes 0, 1 from row r and 2, 3 from row r + 8 (byte b holds L_b, its low
nibble, the even K index, and H_b, its high nibble). The encoding is a fixed permutation of each group's 32 bits.
The decode turns a group into four bf16 pairs, (L0, L1), (L2, L3), (H0, H1), (H2, H3), each one 32-bit register
whose halves hold a code's sign at bit 15 and its three magnitude bits at bits 8-6 (kernels/mxfp4.py explains why
that is the value times 2**-126). In the re-encoded word w, with M = 0x81C081C0 (those bits in both halves):
    (L0, L1) = w & M;   (L2, L3) = rotr(w, 3) & M;   (H0, H1) = rotr(w, 6) & M;
    (H2, H3) = ((w & 0x001B001B) * 0x1084) & M   (three shifted copies, 2, 7 and 12 bits up, that never overlap,
                                                  so the multiply carries nothing).
No four rotations of M's bits tile a 32-bit word (searched), so one register needs the multiply. A first version
that took 4 bytes in a row as the group decoded garbage on the GPU; the interpreter, which runs no PTX, cannot see
the grouping.

Prepared weights (`prepare_mxfp4_weights`) are also laid out tile-major (`tile_major`): each 64-row block's bytes
of one K step are one 4 KB chunk, so a tile's TMA box reads contiguous memory; a tile holds the same bytes in the
same order as from the standard layout, so the decode is unchanged. And each 32-wide K block is stored in the
inverse of the K32 order (`mxfp4.k32_unpermute`): the swapped decode hands the MMA the stored K index of position c
at c (the K32 order, kernels/mxfp4.py), so prepared weights meet their activations in K order and nothing that
feeds them (hidden, the intermediate) is reordered. The scales are unchanged: a 32-wide block keeps its values.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import triton
import triton.language as tl

from tritune.kernels.mxfp4_format import pack_e2m1, unpack_e2m1

PAIR_MASK = 0x81C081C0  # a bf16 pair's sign (15, 31) and magnitude bits (8-6, 24-22)
ROTATIONS = (0, 3, 6)  # (L0, L1), (L2, L3), (H0, H1): rotr by these, then the mask
SPREAD_BITS = 0x001B001B  # (H2, H3): these bits, copied 2, 7 and 12 bits up by one multiply
SPREAD_FACTOR = (1 << 2) | (1 << 7) | (1 << 12)
_PAIR_MASK = tl.constexpr(PAIR_MASK)  # the same for the jitted functions
_SPREAD_BITS = tl.constexpr(SPREAD_BITS)
_SPREAD_FACTOR = tl.constexpr(SPREAD_FACTOR)
GROUP_ROWS = 16  # a group's bytes come from rows r and r + 8 of 16
_FIELD = (6, 7, 8, 15)  # nibble bit i (mantissa, exponent low, exponent high, sign) -> bit of its bf16 half


def _source_bits() -> dict[int, int]:
    """raw bit (byte 8b + 4·high + i) -> re-encoded bit, derived from the four register formulas above."""
    spread = [(p, p + f) for f in (2, 7, 12) for p in range(32) if SPREAD_BITS >> p & 1]
    out = {}
    for reg in range(4):
        for half in range(2):
            byte = half + (2 if reg in (1, 3) else 0)
            for i, field in enumerate(_FIELD):
                target = field + 16 * half
                if reg < 3:
                    src = (target + ROTATIONS[reg]) % 32
                else:
                    (src,) = [p for p, q in spread if q == target]
                out[8 * byte + (4 if reg >= 2 else 0) + i] = src
    if sorted(out.values()) != list(range(32)):
        raise AssertionError("mxfp4_swizzle: the register formulas do not use each bit of a group once")
    return out


SOURCE_BITS = _source_bits()


def _check(packed: torch.Tensor, who: str) -> None:
    if packed.dtype != torch.uint8 or packed.dim() < 2 or packed.shape[-2] % GROUP_ROWS or packed.shape[-1] % 2:
        raise ValueError(f"{who}: want packed uint8 [..., N, K/2] with N a multiple of {GROUP_ROWS} and K of 4, got "
                         f"{packed.dtype} {tuple(packed.shape)}")


def _groups(packed: torch.Tensor, who: str) -> torch.Tensor:
    """packed uint8 [..., N, K/2] -> its groups as int64 words [..., N/16, 8, K/4] (0..2**32 - 1): byte 2a + b of the
    word at [.., g, r, c] is row 16g + 8a + r, byte 2c + b."""
    _check(packed, who)
    *lead, n, half_k = packed.shape
    x = packed.reshape(*lead, n // 16, 2, 8, half_k // 2, 2)
    d = len(lead)
    x = x.permute(*range(d), d, d + 2, d + 3, d + 1, d + 4).reshape(*lead, n // 16, 8, half_k // 2, 4)
    return x.contiguous().view(torch.int32).squeeze(-1).to(torch.int64) & 0xFFFFFFFF  # [.., g, r, c]


def _bytes(words: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`_groups`' inverse: words [..., N/16, 8, K/4] -> uint8 `shape` [..., N, K/2]."""
    *lead, n, half_k = shape
    x = (words & 0xFFFFFFFF).to(torch.int32).unsqueeze(-1).contiguous().view(torch.uint8)  # [.., g, r, c, 4]
    x = x.reshape(*lead, n // 16, 8, half_k // 2, 2, 2)
    d = len(lead)
    return x.permute(*range(d), d, d + 3, d + 1, d + 2, d + 4).reshape(shape).contiguous()


def swizzle_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Standard packed e2m1 bytes [..., N, K/2] -> the re-encoded bytes (same shape, uint8, a new contiguous tensor).
    A 3-D weight goes an expert at a time (the int64 words are 2x its bytes, and the bit moves make a few)."""
    _check(packed, "swizzle_e2m1")
    if packed.dim() >= 3 and packed.shape[0] > 1:
        out = torch.empty(packed.shape, dtype=torch.uint8, device=packed.device)
        for e in range(packed.shape[0]):
            out[e] = swizzle_e2m1(packed[e])
        return out
    groups = _groups(packed, "swizzle_e2m1")
    w = torch.zeros_like(groups)
    for raw, src in SOURCE_BITS.items():
        w |= ((groups >> raw) & 1) << src
    return _bytes(w, packed.shape)


def unswizzle_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """`swizzle_e2m1`'s inverse, by the decode's own register formulas (so it checks them too)."""
    w = _groups(packed, "unswizzle_e2m1")
    regs = [_rotr64(w, r) & PAIR_MASK for r in ROTATIONS] + [((w & SPREAD_BITS) * SPREAD_FACTOR) & PAIR_MASK]
    nib = [[((r >> (16 * h + 6)) & 7) | ((r >> (16 * h + 12)) & 8) for h in range(2)] for r in regs]
    low = nib[0] + nib[1]  # L0..L3
    high = nib[2] + nib[3]  # H0..H3
    raw = sum((low[b] | (high[b] << 4)) << (8 * b) for b in range(4))
    return _bytes(raw, packed.shape)


def _rotr64(w: torch.Tensor, s: int) -> torch.Tensor:
    return ((w >> s) | (w << (32 - s))) & 0xFFFFFFFF if s else w


# Tile-major order: the bytes each K step of a 64-row weight tile reads lie together (4 KB), where the standard
# [E, N, K/2] rows put them 64 bytes a row, K/2 bytes apart. Measured on the H100 (twentieth session,
# probe_decode_floor.py, loads alone of gpt-oss-120b's routed experts at 16 tokens): 204 -> 153 µs for stage 1's
# codes, 117 -> 90 for stage 2's, against 149 and 83 for a plain stream of the same bytes with their scales.
TILE_ROWS = 64  # rows of one tile-major chunk
TILE_K_BYTES = 64  # packed bytes of one chunk's row: one K step of BLOCK_K 128
TILE_BLOCK_K = 2 * TILE_K_BYTES
_TILE_ROWS = tl.constexpr(TILE_ROWS)
_TILE_K_BYTES = tl.constexpr(TILE_K_BYTES)


def tile_major(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [E, N, K/2] -> [E, NB, KS, 64, 64]: chunk (e, b, s) is rows 64b.. of expert e, bytes 64s.. of
    each row, contiguous; NB = ⌈N/64⌉, KS = ⌈K/128⌉, and the rows past N and bytes past K/2 are zero (code 0 decodes
    to 0, which the kernels never store, or multiply by zero-filled activations)."""
    experts, n, half_k = packed.shape
    blocks, steps = triton.cdiv(n, TILE_ROWS), triton.cdiv(half_k, TILE_K_BYTES)
    x = torch.nn.functional.pad(packed, (0, steps * TILE_K_BYTES - half_k, 0, blocks * TILE_ROWS - n))
    return x.reshape(experts, blocks, TILE_ROWS, steps, TILE_K_BYTES).permute(0, 1, 3, 2, 4).contiguous()


def untile(tiles: torch.Tensor, n: int, half_k: int) -> torch.Tensor:
    """`tile_major`'s inverse: [E, NB, KS, 64, 64] -> [E, n, half_k]."""
    experts, blocks, steps, rows, width = tiles.shape
    x = tiles.permute(0, 1, 3, 2, 4).reshape(experts, blocks * rows, steps * width)
    return x[:, :n, :half_k].contiguous()


@dataclass(frozen=True, eq=False)  # identity: the op keys its per-call caches on the object
class Mxfp4Weights:
    """One MXFP4 weight's packed bytes, re-encoded (`swizzle_e2m1`) and laid out tile-major (`tile_major`): what
    `prepare_mxfp4_weights` returns, taken by the fused-MoE op and stage functions wherever they take packed
    weights. Only the swapped GEMM through TMA with BLOCK_K 128 reads them (`fused_moe.reads_prepared`; the bf16
    decode through the re-encoded PTX, fp16 and the interpreter undoing the encoding per tile)."""

    tiles: torch.Tensor  # uint8 [E, NB, KS, 64, 64]
    rows: int  # N, the weight's rows per expert
    half_k: int  # K/2, the packed bytes of a row

    @property
    def shape(self) -> torch.Size:
        """The standard packed shape [E, N, K/2]."""
        return torch.Size((self.tiles.shape[0], self.rows, self.half_k))

    @cached_property  # made once: the op reads it on every call
    def view(self) -> torch.Tensor:
        """The tiles seen with the standard shape [E, N, K/2]: what shape checks, plan keys and launch arguments
        read. Its strides (expert, 64, 1) are not the layout; kernels read the bytes through `tile_view`."""
        return torch.as_strided(self.tiles, self.shape, (self.tiles.stride(0), TILE_K_BYTES, 1))

    def packed(self) -> torch.Tensor:
        """The re-encoded bytes in the standard layout [E, N, K/2], each 32-wide K block in the inverse K32 order (a
        copy; tests and tools)."""
        return untile(self.tiles, self.rows, self.half_k)

    def standard(self) -> torch.Tensor:
        """The standard packed bytes [E, N, K/2] these were prepared from (a copy; tests and tools)."""
        return k32_order_bytes(unswizzle_e2m1(self.packed()), inverse=False)


def tile_view_shape(experts: int, n: int, half_k: int) -> tuple[int, int, int]:
    """The tile-major TMA view of a prepared weight [E, N, K/2]: [E·NB, KS·64, 64], row (b, 64s + r) holding row r of
    chunk s of 64-row block b, so a tile of BLOCK_N rows at K step s is one box (`tile_box`)."""
    return experts * triton.cdiv(n, TILE_ROWS), triton.cdiv(half_k, TILE_K_BYTES) * TILE_ROWS, TILE_K_BYTES


def tile_view(view: torch.Tensor) -> torch.Tensor:
    """The bytes behind an `Mxfp4Weights.view` as `tile_view_shape` says."""
    shape = tile_view_shape(*view.shape)
    return torch.as_strided(view, shape, (shape[1] * shape[2], shape[2], 1), view.storage_offset())


def tile_box(block_n: int, block_k: int) -> list[int]:
    """One K step of a BLOCK_N × BLOCK_K tile (BLOCK_K at most 128) in `tile_view`: whole 64-row chunks or part of
    one, a chunk's row or part of it."""
    return [max(block_n // TILE_ROWS, 1), min(block_n, TILE_ROWS), min(block_k // 2, TILE_K_BYTES)]


def prepare_mxfp4_weights(packed: torch.Tensor) -> Mxfp4Weights:
    """Store a packed e2m1 weight [E, N, K/2] for the swapped GEMM, for its lifetime (a copy: prepare again if it
    changes): each 32-wide K block in the inverse K32 order (`k32_order_bytes`), re-encoded, laid out tile-major."""
    if packed.dim() != 3:
        raise ValueError(f"prepare_mxfp4_weights: want packed uint8 [E, N, K/2], got {tuple(packed.shape)}")
    if (2 * packed.shape[2]) % 32:
        raise ValueError(f"prepare_mxfp4_weights: K = {2 * packed.shape[2]} (2 x the last dimension) is not a "
                         "multiple of 32")
    n = packed.shape[1]
    natural = torch.empty(packed.shape, dtype=torch.uint8, device=packed.device)
    for e in range(packed.shape[0]):  # an expert at a time: the codes take 2x its bytes, the reorder as many again
        natural[e] = k32_order_bytes(packed[e], inverse=True)
    padded = torch.nn.functional.pad(natural, (0, 0, 0, triton.cdiv(n, TILE_ROWS) * TILE_ROWS - n))
    return Mxfp4Weights(tile_major(swizzle_e2m1(padded)), n, packed.shape[2])


def k32_order_bytes(packed: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Packed e2m1 bytes [..., K/2] (byte j: K index 2j in its low nibble, 2j + 1 in its high one) with each 32-wide
    K block's codes put in the K32 order (`mxfp4.k32_permute`), or with `inverse` in its inverse (`k32_unpermute`):
    the order prepared weights are stored in, and back."""
    from tritune.kernels.mxfp4 import k32_permute, k32_unpermute  # mxfp4 imports this module

    codes = unpack_e2m1(packed)
    return pack_e2m1(k32_unpermute(codes) if inverse else k32_permute(codes))


def check_prepared_device(w: torch.Tensor) -> None:
    """Prepared weights decode in the Hopper wgmma's register order: refuse them on other GPUs (the interpreter
    undoes the encoding per tile and runs them anywhere)."""
    if w.is_cuda and torch.cuda.get_device_capability(w.device)[0] != 9:
        raise ValueError(f"prepared MXFP4 weights (prepare_mxfp4_weights) decode in Hopper's wgmma register order; "
                         f"{torch.cuda.get_device_name(w.device)} is not Hopper: pass the standard packed bytes")


def split_weights(w: torch.Tensor | Mxfp4Weights) -> tuple[torch.Tensor, bool]:
    """(the tensor a launch takes, whether it is prepared: re-encoded and tile-major) of a weight argument that may
    be either form."""
    if isinstance(w, Mxfp4Weights):
        return w.view, True
    return w, False


@triton.jit
def tile_major_bytes(w_ptr, rows, k0, K, BLOCK_K: tl.constexpr):
    """The packed bytes [BLOCK_N, BLOCK_K // 2] of rows `rows`, K indices [k0, k0 + BLOCK_K), from one expert's
    tile-major bytes at w_ptr, by pointers (the path without TMA); 0 past K."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    chunk = _TILE_ROWS * _TILE_K_BYTES
    block_bytes = tl.cdiv(K // 2, _TILE_K_BYTES) * chunk  # a 64-row block's chunks, every K step
    offs = ((rows // _TILE_ROWS) * block_bytes + (rows % _TILE_ROWS) * _TILE_K_BYTES)[:, None]
    offs += ((kb // _TILE_K_BYTES) * chunk + kb % _TILE_K_BYTES)[None, :]
    return tl.load(w_ptr + offs, mask=kb[None, :] < K // 2, other=0)


@triton.jit
def _rotr(w, s: tl.constexpr):
    return (w >> s) | (w << (32 - s))


@triton.jit
def _nibbles(reg):
    """The two e2m1 codes (low half, high half) a decoded register holds: sign bit 15 -> 3, bits 8-6 -> 2-0."""
    return ((reg >> 6) & 7) | ((reg >> 12) & 8), ((reg >> 22) & 7) | ((reg >> 28) & 8)


@triton.jit
def unswizzle_tile(packed, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr):
    """A tile of re-encoded bytes [BLOCK_N, HALF_K] (uint8; BLOCK_N a multiple of 16, its rows and columns aligned to
    the groups) -> the standard packed bytes, by the PTX decode's register formulas in Triton's integer ops: the
    interpreter's and fp16's path (slow: the bf16 GPU path never calls it)."""
    q = tl.reshape(packed.to(tl.uint32), (BLOCK_N // 16, 2, 8, HALF_K // 2, 2))
    q = tl.permute(q, (0, 2, 3, 1, 4))  # [g, r, c, a, b]: byte 2a + b of each group last
    even, odd = tl.split(q)  # b = 0: bytes (0, 2); b = 1: bytes (1, 3)
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    w = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    l0, l1 = _nibbles(w & _PAIR_MASK)
    l2, l3 = _nibbles(_rotr(w, 3) & _PAIR_MASK)
    h0, h1 = _nibbles(_rotr(w, 6) & _PAIR_MASK)
    h2, h3 = _nibbles(((w & _SPREAD_BITS) * _SPREAD_FACTOR) & _PAIR_MASK)
    r0, r1, r2, r3 = l0 | (h0 << 4), l1 | (h1 << 4), l2 | (h2 << 4), l3 | (h3 << 4)
    raw = tl.join(tl.join(r0, r2), tl.join(r1, r3))  # [g, r, c, a, b] = byte 2a + b again
    return tl.reshape(tl.permute(raw, (0, 3, 1, 2, 4)), (BLOCK_N, HALF_K)).to(tl.uint8)
