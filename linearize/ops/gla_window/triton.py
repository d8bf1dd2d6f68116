"""Triton kernels for Lizard attention: gated linear attention + sliding-window softmax with sinks.

Forward, one fused pass (docs/kernels.md has the full design): a program per (batch, head, block of
value columns) walks the sequence chunk by chunk and computes both branches of each chunk:
  - gated linear part in log space: A = cumulative log decay from the chunk start, folded into the
    operands (q~ = phi_q e^A, k~ = phi_k e^(A_end - A), intra-chunk e^(A_i - A_j)), so every exponent
    is <= 0 and the products are plain tensor-core GEMMs; its block of the state S and the normaliser
    z (the "ones column" of V) stay in float32 registers across chunks;
  - anchor window: the queries of chunk n see the keys of chunks n - NWB .. n only
    (NWB = ceil((w - 1) / chunk)); online softmax whose running max and sum start from the sinks.
Backward: two fully parallel flash-attention-style kernels for the window (dq, which also gives the
linear part's per-token d den; dk, dv), then dq and dk passes over blocks of state rows (features)
and a dv pass over blocks of state columns, which walk the chunks recomputing the state (or its
gradient) as they go. With the split kernels (`Config.split`: a sequential pass stores the state, or
its gradient, at every chunk, and every chunk is a program of its own) and a scalar gate, one kernel
a chunk takes the linear part's dq, dk and dv at once (`_bwd_chunk_kernel`). The per-token d log g is a reverse cumsum of fq.dfq - fk.dfk,
finished with the GQA and per-program sums.

Importing this module needs triton; the dispatch in `linearize.ops.gla_window` guards that import.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from .options import GlaWindowOptions

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    from .. import _interpreter

    _interpreter.patch()

VECTOR_GATE_CHUNK = 16  # per-feature decays are formed key by key inside a chunk (see _decays_from)
MAX_SINKS = 16
DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclasses.dataclass(frozen=True)
class Config:
    """Block sizes, warps and pipelining per kernel family (the defaults: H200 sweeps, docs/kernels.md)."""

    chunk: int  # scalar-gate chunk (the vector gate always uses VECTOR_GATE_CHUNK)
    block_v: int = 64  # value columns per program of the forward
    # The backward's per-pass kernels (a vector gate, the one-pass kernels, fused_backward=False):
    dv_block_v: int = 64  # value columns per program of the dv pass
    block_k: int = 64  # state rows (features) per program of the dq and dk passes
    window_dq_block: int = 64  # query rows per program of the backward's window dq pass
    window_dkv_block: int = 64  # key rows per program of the backward's window dk/dv pass
    warps: int = 8
    stages: int = 1  # Triton's software pipelining of the loops' loads (num_stages)
    # State rows (features) and value columns per program of the split kernels' sequential state
    # passes: smaller blocks, more programs and fewer registers a program (fla's chunk_fwd_h splits the
    # same way, 64 x 64). The backward's pass has rows of its own (`dstate_block_k`).
    state_block_k: int = 128
    state_block_v: int = 128
    state_warps: int = 8  # the forward state pass's warps and software pipelining (Triton's num_stages)
    state_stages: int = 1
    # The forward chunk kernel's pipelining and register cap (ptxas's maxnreg; None: as many as it
    # takes; taken with `tma` only: through pointer loads the cap spills). At 1 stage and 168
    # registers three of its 4-warp programs share an H200 SM, not two: its window loop then keeps no
    # second buffer of keys and values (docs/kernels.md).
    forward_stages: int = 1
    forward_registers: int | None = None
    dstate_block_k: int = 128
    # Chunk-parallel kernels, as fla does: one light sequential pass stores the state at every chunk
    # start (forward) and its gradient at every chunk end (backward), then every chunk's outputs and
    # gradients are computed at once. More parallelism, one [NT, F, D] state per chunk in memory.
    split: bool = False
    # Launch order: the chunk (or the window kernels' block of rows) on grid axis 0 and the head on the
    # last, so that programs of one head's neighbouring chunks run side by side and find the window's
    # key and value tiles, which each also reads for its neighbours, in L2. Head first (False), the
    # programs of one chunk of every head run together instead.
    chunks_first: bool = False
    # The split backward's d fq, d fk and d v in one kernel a chunk (`_bwd_chunk_kernel`), which forms
    # the chunk's dP once instead of once for each block of features of the dq and dk passes. Taken
    # where it applies: split kernels and a scalar gate (a vector gate's 16-token chunks go key by key).
    fused_backward: bool = True
    # The forward chunk kernel's tiles copied by Hopper's tensor memory accelerator (tensor descriptors)
    # rather than by pointer loads: no address or mask registers, no spills; taken on GPUs that have
    # one (compute capability 9 and up) and in the interpreter. The state pass keeps pointer loads
    # (through descriptors it took 3.11 ms against 2.74 at B=32, L=8K: docs/kernels.md).
    tma: bool = False

    def __post_init__(self):
        # Triton's block shapes are powers of two; tl.dot needs at least 16 rows and columns.
        for name in ("chunk", "block_v", "dv_block_v", "block_k", "window_dq_block", "window_dkv_block",
                     "state_block_k", "state_block_v", "dstate_block_k"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"Config.{name} must be a power of two >= 16, got {size}")
        for warps, stages in ((self.warps, self.stages), (self.state_warps, self.state_stages),
                              (self.warps, self.forward_stages)):
            if warps not in (1, 2, 4, 8, 16) or stages < 1:
                raise ValueError(f"Config needs warps in 1/2/4/8/16 and stages >= 1, got {warps}, {stages}")
        if self.forward_registers is not None and not 24 <= self.forward_registers <= 255:
            raise ValueError(f"Config.forward_registers must be None or 24..255, got {self.forward_registers}")

    @property
    def chunk_axis_first(self) -> bool:
        """The chunk kernels' CF: only the split kernels have a chunk axis to put first (`_grid`)."""
        return self.chunks_first and self.split

    def fuses_backward(self, vec: bool) -> bool:
        """Whether the backward takes `_bwd_chunk_kernel`; `vec`: the gate is per feature."""
        return self.fused_backward and self.split and not vec

    @staticmethod
    @functools.cache  # frozen, so one instance serves every call (each forward asks, before its first launch)
    def default(dtype: torch.dtype) -> Config:
        # float32 (3xTF32) operands take twice the registers and shared memory of 16-bit ones (untimed).
        if dtype == torch.float32:
            return Config(chunk=32, window_dq_block=32, window_dkv_block=32, state_block_v=64)
        # The fastest of the H200 sweeps (docs/kernels.md): at B=16, H=32, F=D=128, L=2K, chunks first
        # gives 1.40 / 6.87 ms forward / forward+backward against 1.62 / 7.25 with the heads first, and
        # each kernel's blocks are the fastest of its profiles of one change at a time; at B=32, L=8K the
        # forward state pass at 3 stages takes 2.74 ms against 2.90, the chunk kernel's tiles through TMA
        # 6.79 against 7.04, and the chunk kernel at 1 stage under 168 registers (three programs an SM)
        # 6.05 against 7.5-7.6 at two programs an SM; the state pass's blocks, warps and stages are the
        # fastest of 63 (2.37 ms at B=32, L=8K).
        return Config(chunk=64, block_v=128, dv_block_v=64, window_dq_block=64, window_dkv_block=32, warps=4,
                      stages=2, split=True, state_block_k=128, dstate_block_k=64, chunks_first=True, state_warps=4,
                      state_stages=3, tma=True, forward_stages=1, forward_registers=168)


# ----------------------------------------------------------------------------------------------------
# Building blocks


@triton.jit
def _dot_acc(a, b, acc, DT: tl.constexpr):
    """acc + a @ b on DT operands (the inputs' dtype), accumulated in float32 in place.

    float32 inputs use 3xTF32: tensor cores at about float32 accuracy (plain TF32 loses ~1e-3).
    """
    if DT == tl.float32:
        out = tl.dot(a.to(DT), b.to(DT), acc=acc, input_precision="tf32x3")
    else:
        out = tl.dot(a.to(DT), b.to(DT), acc=acc)
    return out


@triton.jit
def _dot(a, b, DT: tl.constexpr):
    return _dot_acc(a, b, tl.zeros([a.shape[0], b.shape[1]], tl.float32), DT)


@triton.jit
def _load_tile(ptr, pos, L, STRIDE: tl.constexpr, BW: tl.constexpr):
    """[rows pos, columns 0..BW) of a row-major matrix with row stride STRIDE; rows >= L read as zeros.

    Kept in the stored dtype (half the registers for bfloat16): tensor-core operands as they are;
    a product with a float32 factor promotes to float32.
    """
    cols = tl.arange(0, BW)
    return tl.load(ptr + pos[:, None] * STRIDE + cols[None, :], mask=(pos < L)[:, None], other=0.0)


@triton.jit
def _head_rows(X, head, first, col, L, STRIDE: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr, TMA: tl.constexpr):
    """Rows first..first+BT, columns col..col+BW of head `head` of X [heads, L, STRIDE]; rows >= L read
    as zeros. X is a pointer, or with TMA a tensor descriptor of block [1, BT, BW] (Hopper's tensor
    memory accelerator copies the tile to shared memory itself: no address or mask registers)."""
    if TMA:
        out = X.load([head.to(tl.int32), first, col]).reshape(BT, BW)
    else:
        out = _load_tile(X + head * L * STRIDE + col, first + tl.arange(0, BT), L, STRIDE, BW)
    return out


@triton.jit
def _store_tile(ptr, pos, L, x, STRIDE: tl.constexpr, BW: tl.constexpr):
    cols = tl.arange(0, BW)
    tl.store(ptr + pos[:, None] * STRIDE + cols[None, :], x.to(ptr.dtype.element_ty), mask=(pos < L)[:, None])


@triton.jit
def _load_gate(LG, pos, L, F: tl.constexpr, BK: tl.constexpr, VEC: tl.constexpr):
    """Cumulative log decay A from the chunk start (inclusive) and its total over the chunk.

    Vector gate: features 0..BK of LG (row stride F). Rows past the end read log g = 0: they neither
    decay the state nor add to it (their keys are zero).
    """
    if VEC:
        g = _load_tile(LG, pos, L, F, BK).to(tl.float32)
    else:
        g = tl.load(LG + pos, mask=pos < L, other=0.0).to(tl.float32)
    return tl.cumsum(g, 0), tl.sum(g, 0)


@triton.jit
def _q_decay(A, VEC: tl.constexpr):
    """e^{A_i}: decay from the chunk start to query i, shaped to scale [chunk, features] rows."""
    if VEC:
        out = tl.exp(A)
    else:
        out = tl.exp(A)[:, None]
    return out


@triton.jit
def _k_decay(A, a_end, VEC: tl.constexpr):
    """e^{A_end - A_j}: decay from key j to the chunk end, shaped to scale [chunk, features] rows."""
    if VEC:
        out = tl.exp(a_end[None, :] - A)
    else:
        out = tl.exp(a_end - A)[:, None]
    return out


@triton.jit
def _decay_state(S, a_end, VEC: tl.constexpr):
    """The state [features, columns] decayed over a whole chunk."""
    if VEC:
        out = S * tl.exp(a_end)[:, None]
    else:
        out = S * tl.exp(a_end)
    return out


@triton.jit
def _scalar_decay(A, t):
    """Causal [chunk, chunk] matrix e^{A_i - A_j} (i >= j), zero above the diagonal."""
    return tl.exp(tl.where(t[:, None] >= t[None, :], A[:, None] - A[None, :], float("-inf")))


@triton.jit
def _decays_from(A, t, j):
    """Per-feature decays e^{A_i - A_j} from key row j to every query row i (zero for i < j).

    A vector gate has no single reference point r that keeps both e^{A_i - A_r} and e^{A_r - A_j}
    bounded inside a chunk, so its intra-chunk products are formed exactly, key by key.
    """
    a_j = tl.sum(tl.where((t == j)[:, None], A, 0.0), 0)
    return tl.exp(tl.where((t >= j)[:, None], A - a_j[None, :], float("-inf")))


@triton.jit
def _row(x, t, j):
    return tl.sum(tl.where((t == j)[:, None], x, 0.0), 0)


@triton.jit
def _vector_scores(q, k, A, t, BT: tl.constexpr):
    """Intra-chunk P_ij = sum_f q_if k_jf e^{A_if - A_jf} (i >= j) for a vector gate."""
    P = tl.zeros([BT, BT], tl.float32)
    for j in range(BT):
        q_e_k = q * _decays_from(A, t, j) * _row(k, t, j)[None, :]
        P = tl.where(t[None, :] == j, tl.sum(q_e_k, 1)[:, None], P)
    return P


@triton.jit
def _window_scores(qw, kw, qpos, kpos, window, scale, DT: tl.constexpr):
    """Scaled logits q.k, -inf outside the band kpos in (qpos - w, qpos]."""
    s = _dot(qw, tl.trans(kw), DT) * scale
    diff = qpos[:, None] - kpos[None, :]
    return tl.where((diff >= 0) & (diff < window), s, float("-inf"))


@triton.jit
def _dy_rows(DY, bh, H, dy_b, dy_h):
    """Head bh's rows of dy: [B, H, L, D] or, as the model's o_proj hands it back uncopied, [B, L, H, D]
    (batch and head strides dy_b, dy_h; each kernel's DY_ROW is the row stride)."""
    return DY + (bh // H) * dy_b + (bh % H) * dy_h


@triton.jit
def _sink_logits(SINKS, M: tl.constexpr, MP: tl.constexpr):
    idx = tl.arange(0, MP)
    return tl.load(SINKS + idx, mask=idx < M, other=float("-inf")).to(tl.float32)


# ----------------------------------------------------------------------------------------------------
# Kernels. Layouts (contiguous): FQ, FK [B,H,L,F]; LG [B,H,L,1 or F]; QW, Y* [B,H,L,D]; KW, V
# [B,HKV,L,D]; per-token statistics [B*H, L] float32. Axis 0 of every grid is b * H + h.


@triton.jit
def _sink_start(SINKS, h, M: tl.constexpr, MP: tl.constexpr):
    """Running softmax max and sum before any key: the sinks add mass to the denominator only."""
    if M > 0:
        sinks = _sink_logits(SINKS + h * M, M, MP)
        m0 = tl.max(sinks, 0)
        l0 = tl.sum(tl.exp(sinks - m0), 0)
    else:
        m0 = -1e30  # finite, so exp(m_old - m_new) never sees inf - inf
        l0 = 0.0
    return m0, l0


@triton.jit
def _advance_state(S, z, k, v, A, a_end, VEC: tl.constexpr, DT: tl.constexpr):
    """S, z carried over one chunk: decayed across it, plus its keys decayed to its end."""
    k_dec = k * _k_decay(A, a_end, VEC)
    S = _dot_acc(tl.trans(k_dec), v, _decay_state(S, a_end, VEC), DT)
    z = z * tl.exp(a_end) + tl.sum(k_dec, 0)
    return S, z


@triton.jit
def _linear_scores(q, k, A, z, t, eps, BT: tl.constexpr, VEC: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr):
    """The gated linear part's intra-chunk scores P, its decayed queries (to meet the state carried
    from earlier chunks) and its denominator: the "ones column" of V, or 1 unnormalised (Liger)."""
    if VEC:
        P = _vector_scores(q.to(tl.float32), k.to(tl.float32), A, t, BT)
    else:
        P = _dot(q, tl.trans(k), DT) * _scalar_decay(A, t)
    q_dec = q * _q_decay(A, VEC)
    if NORM:
        den = tl.sum(P, 1) + tl.sum(q_dec * z[None, :], 1) + eps
    else:  # a denominator of 1 keeps the backward's formulas
        den = tl.zeros([BT], tl.float32) + 1.0
    return P, q_dec, den


@triton.jit
def _online_softmax(s, first_key, v, m, l, arg, acc, DT: tl.constexpr):
    """One tile of masked logits s (keys first_key..) into a running softmax: the row max m, the sum l
    relative to it, the key holding it (arg) and the weighted sum of v (acc)."""
    tile_max = tl.max(s, 1)
    arg = tl.where(tile_max > m, first_key + tl.argmax(s, 1).to(tl.int32), arg)
    m_new = tl.maximum(m, tile_max)
    p = tl.exp(s - m_new[:, None])
    corr = tl.exp(m - m_new)
    return m_new, l * corr + tl.sum(p, 1), arg, _dot_acc(p, v, acc * corr[:, None], DT)


@triton.jit
def _window_sums(QW, KW, V, bh, kv, col, n, t, L, window, scale, m0, l0, D: tl.constexpr, BV: tl.constexpr,
                 BT: tl.constexpr, NWB: tl.constexpr, TMA: tl.constexpr, DT: tl.constexpr):
    """Anchor window: online softmax over the key chunks that overlap (pos - w, pos]. The unnormalised
    sum (relative to the running max), the max, the key that holds it (-1: a sink) and the softmax sum.
    Query head bh, key/value head kv, value columns col.. (`_head_rows`)."""
    pos = n * BT + t
    qw = _head_rows(QW, bh, n * BT, 0, L, D, BT, D, TMA)
    m_i = tl.zeros([BT], tl.float32) + m0
    l_i = tl.zeros([BT], tl.float32) + l0
    arg = tl.zeros([BT], tl.int32) - 1
    acc = tl.zeros([BT, BV], tl.float32)
    for mb in range(tl.maximum(n - NWB, 0), n + 1):
        kw = _head_rows(KW, kv, mb * BT, 0, L, D, BT, D, TMA)
        s = _window_scores(qw, kw, pos, mb * BT + t, window, scale, DT)
        vb = _head_rows(V, kv, mb * BT, col, L, D, BT, BV, TMA)
        m_i, l_i, arg, acc = _online_softmax(s, mb * BT, vb, m_i, l_i, arg, acc, DT)
    return acc, m_i, l_i, arg


@triton.jit
def _store_outputs(Y, Y_WIN, DEN, LSE, ROW_MAX, ARG, y_out, y_row, out, stat, pos, L, y_gla, y_win, alpha,
                   den, m_i, l_i, arg, first, D: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr,
                   SHARED: tl.constexpr):
    """y at Y + y_out, rows y_row apart (the [B, L, H, d] layout); the saved parts (y_gla is already)
    at their own + out."""
    if SHARED:  # one normaliser: (window numerator + linear numerator) / (l_i + den), l_i relative to m_i
        y = (y_win * l_i[:, None] + y_gla * den[:, None]) / (l_i + den)[:, None]
    else:
        y = y_gla + alpha * y_win
    cols = tl.arange(0, BV)
    tl.store(Y + y_out + pos[:, None] * y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=(pos < L)[:, None])
    if SAVE:
        _store_tile(Y_WIN + out, pos, L, y_win, D, BV)
        if first:
            tl.store(DEN + stat + pos, den, mask=pos < L)
            tl.store(LSE + stat + pos, m_i + tl.log(l_i), mask=pos < L)
            if SHARED:
                tl.store(ROW_MAX + stat + pos, m_i, mask=pos < L)
                tl.store(ARG + stat + pos, arg, mask=pos < L)


@triton.jit
def _state_before_chunks(HS, R: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr):
    """A [R, C] state (or state gradient) before the chunk loop: carried in float32 by the one-pass
    kernels, loaded per chunk in its stored dtype by the split ones (`_load_chunk_state`)."""
    if SPLIT:
        out = tl.zeros([R, C], HS.dtype.element_ty)
    else:
        out = tl.zeros([R, C], tl.float32)
    return out


@triton.jit
def _head(CF: tl.constexpr, LAST: tl.constexpr):
    """b * H + h of this program: grid axis 0, or axis LAST where the chunks come first (CF, `_grid`)."""
    if CF:
        bh = tl.program_id(LAST)
    else:
        bh = tl.program_id(0)
    return bh.to(tl.int64)


@triton.jit
def _chunks(NT, SPLIT: tl.constexpr, CF: tl.constexpr):
    """The chunks this program covers: all, in order, or (split) only the one on its grid axis: the
    last, or 0 where the chunks come first (CF)."""
    if SPLIT:
        if CF:
            first = tl.program_id(0)
        else:
            first = tl.program_id(2)
        last = first + 1
    else:
        first = 0
        last = NT
    return first, last


@triton.jit
def _row_block(CF: tl.constexpr):
    """A window kernel's block of rows (the fused backward's chunk) and the number of blocks: grid
    axis 1, or 0 where CF."""
    if CF:
        n, blocks = tl.program_id(0), tl.num_programs(0)
    else:
        n, blocks = tl.program_id(1), tl.num_programs(1)
    return n, blocks


@triton.jit
def _fwd_kernel(FQ, FK, LG, QW, KW, V, SINKS, ALPHA, HS, HZ, Y, Y_GLA, Y_WIN, DEN, LSE, ROW_MAX, ARG,
                L, H, HKV, NT, window, scale, eps, HEAD,
                F: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, NWB: tl.constexpr,
                M: tl.constexpr, MP: tl.constexpr, VEC: tl.constexpr, SAVE: tl.constexpr, SPLIT: tl.constexpr,
                NORM: tl.constexpr, SHARED: tl.constexpr, CF: tl.constexpr, TMA: tl.constexpr, DT: tl.constexpr,
                KEEP_HEAD: tl.constexpr):
    """Grid (B*H, D/BV[, NT]) (`_grid`): output columns [iv*BV, (iv+1)*BV). One pass walks the chunks
    carrying that block of the state; split, each program takes one chunk and its starting state from
    HS, HZ (`_fwd_states_kernel`). The scores are recomputed by each column block. Y is [B, L, H, d]:
    the layout the model's o_proj reads, so no transpose copy follows. With TMA, FQ, FK, QW, KW, V
    and HS are tensor descriptors (`_head_rows`; HS viewed [B*H*NT, F, D]). With KEEP_HEAD (and not
    SAVE), the first HEAD rows' window part and statistics go to Y_WIN [B*H, HEAD, D] and DEN, LSE,
    ROW_MAX [B*H, HEAD] (what a continued call needs to add the carried window keys to those rows)."""
    bh = _head(CF, 2)
    iv = tl.program_id(1)
    h = bh % H
    y_out = (bh // H) * L * H * D + h * D + iv * BV
    kv = (bh // H) * HKV + h // (H // HKV)
    LG += bh * L * (F if VEC else 1)
    HZ += bh * NT * F
    col = iv * BV  # this program's value columns
    t = tl.arange(0, BT)
    rows = tl.arange(0, F)
    alpha = tl.load(ALPHA + h).to(tl.float32)
    m0, l0 = _sink_start(SINKS, h, M, MP)

    if TMA and SPLIT:  # a descriptor's dtype is its element type
        S = tl.zeros([F, BV], HS.dtype)
    else:
        S = _state_before_chunks(HS, F, BV, SPLIT)
    z = tl.zeros([F], tl.float32)
    # Registers and shared memory for three programs an SM (docs/kernels.md): y_gla waits in memory
    # while the window runs (where it is saved anyway, or in the output's own rows, still in L2), and
    # the state and v load only once the scores have used q and k, whose shared memory they take over.
    if SAVE:
        Y_PART, part_row = Y_GLA + bh * L * D + col, D
    else:
        Y_PART, part_row = Y + y_out, H * D
    first, last = _chunks(NT, SPLIT, CF)
    for n in range(first, last):
        pos = n * BT + t
        if SPLIT:
            z = tl.load(HZ + n * F + rows)
        q = _head_rows(FQ, bh, n * BT, 0, L, F, BT, F, TMA)
        k = _head_rows(FK, bh, n * BT, 0, L, F, BT, F, TMA)
        A, a_end = _load_gate(LG, pos, L, F, F, VEC)
        P, q_dec, den = _linear_scores(q, k, A, z, t, eps, BT, VEC, NORM, DT)
        if SPLIT:  # HS viewed as [B*H*NT, F, D]; S in its stored dtype (only ever a GEMM operand)
            S = _head_rows(HS, bh * NT + n, 0, col, F, D, F, BV, TMA)
        y_gla = _dot(q_dec, S, DT)
        v = _head_rows(V, kv, n * BT, col, L, D, BT, BV, TMA)
        y_gla = _dot_acc(P, v, y_gla, DT) / den[:, None]
        _store_tile(Y_PART, pos, L, y_gla, part_row, BV)
        tl.debug_barrier()  # every thread's y_gla rows stored before any reads them back
        acc, m_i, l_i, arg = _window_sums(QW, KW, V, bh, kv, col, n, t, L, window, scale, m0, l0, D, BV, BT, NWB,
                                          TMA, DT)
        y_gla = _load_tile(Y_PART, pos, L, part_row, BV).to(tl.float32)
        tl.debug_barrier()  # and read back by all before y, in its own layout, overwrites them in Y
        _store_outputs(Y, Y_WIN, DEN, LSE, ROW_MAX, ARG, y_out, H * D, bh * L * D + col, bh * L, pos, L, y_gla,
                       acc / l_i[:, None], alpha, den, m_i, l_i, arg, iv == 0, D, BV, SAVE, SHARED)
        if KEEP_HEAD:  # noqa: SIM102 (a compile-time branch: other kernels hold no code for the head rows)
            if n * BT < HEAD:
                _store_tile(Y_WIN + bh * HEAD * D + col, pos, HEAD, acc / l_i[:, None], D, BV)
                if iv == 0:
                    at, head = bh * HEAD + pos, pos < HEAD
                    tl.store(DEN + at, den, mask=head)
                    tl.store(LSE + at, m_i + tl.log(l_i), mask=head)
                    tl.store(ROW_MAX + at, m_i, mask=head)
        if not SPLIT:
            S, z = _advance_state(S, z, k, v, A, a_end, VEC, DT)


@triton.jit
def _store_chunk_state(HS, HZ, n, S, z, write_z, F: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr):
    """Chunk n's entry of a stored state: a [BK, BV] block of S (HS, HZ point at its first row) and,
    from one program of the row block, those rows of z."""
    rows = tl.arange(0, BK)
    _store_tile(HS + n * F * D, rows, BK, S, D, BV)
    if write_z:
        tl.store(HZ + n * F + rows, z)


@triton.jit
def _load_chunk_state(HS, HZ, n, rows, F: tl.constexpr, D: tl.constexpr, BW: tl.constexpr):
    """Chunk n's entry of a stored state: rows `rows` (columns 0..BW) of S, in its stored dtype (only
    ever a GEMM operand, which takes it so: float32 would hold twice the registers, and the forward
    spilled), and of z (float32)."""
    return _load_tile(HS + n * F * D, rows, F, D, BW), tl.load(HZ + n * F + rows)


@triton.jit
def _store_da_share(DA, pos, L, share, F: tl.constexpr, BK: tl.constexpr, VEC: tl.constexpr):
    """A [chunk, BK] share of dA: per feature for a vector gate, summed over the block for a scalar one."""
    if VEC:
        _store_tile(DA, pos, L, share, F, BK)
    else:
        tl.store(DA + pos, tl.sum(share, 1), mask=pos < L)


@triton.jit
def _fwd_states_kernel(FK, LG, V, HS, HZ, S0, Z0, S_END, Z_END, L, H, HKV, NT,
                       F: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                       VEC: tl.constexpr, DT: tl.constexpr, CARRY: tl.constexpr):
    """Grid (B*H * F/BK * D/BV,), for the split kernels: the state at the start of every chunk, HS
    [B*H, NT, F, D] in the inputs' dtype (the GEMMs that read it take it so anyway) and HZ [B*H, NT, F]
    in float32; a program carries rows [ik*BK, (ik+1)*BK) and columns [iv*BV, (iv+1)*BV): a state row
    depends only on its own feature of the keys. A head's blocks come first in the launch order, so
    they run side by side and share its key and value tiles through L2. With CARRY (a prefill
    continuing a cache) the state starts from S0 [B*H, F, D], Z0 [B*H, F] and the state after the last
    token goes to S_END, Z_END (float32, same shapes)."""
    pid = tl.program_id(0)
    iv = pid % (D // BV)
    fo = pid // (D // BV) % (F // BK) * BK
    bh = (pid // (D // BV * (F // BK))).to(tl.int64)
    kv = (bh // H) * HKV + (bh % H) // (H // HKV)
    FK += bh * L * F + fo
    LG += bh * L * F + fo if VEC else bh * L
    VB = V + kv * L * D + iv * BV
    block = bh * F * D + fo * D + iv * BV  # this program's block of an [F, D] state
    HS += bh * NT * F * D + fo * D + iv * BV
    HZ += bh * NT * F + fo
    t = tl.arange(0, BT)
    rows = tl.arange(0, BK)
    if CARRY:
        S = _load_tile(S0 + block, rows, BK, D, BV)
        z = tl.load(Z0 + bh * F + fo + rows)
    else:
        S = tl.zeros([BK, BV], tl.float32)
        z = tl.zeros([BK], tl.float32)
    for n in range(NT):
        _store_chunk_state(HS, HZ, n, S, z, iv == 0, F, D, BK, BV)
        pos = n * BT + t
        A, a_end = _load_gate(LG, pos, L, F, BK, VEC)
        v = _load_tile(VB, pos, L, D, BV)
        if VEC:
            S, z = _advance_state(S, z, _load_tile(FK, pos, L, F, BK), v, A, a_end, VEC, DT)
        else:
            # A scalar gate's decay to the chunk end scales the values instead of the keys, so the keys
            # go into the GEMM as loaded, already transposed ([BK, BT]: no layout change in registers).
            k_t = tl.load(FK + rows[:, None] + pos[None, :] * F, mask=(pos < L)[None, :], other=0.0)
            decay = tl.exp(a_end - A)
            S = _dot_acc(k_t, (v * decay[:, None]).to(v.dtype), S * tl.exp(a_end), DT)
            z *= tl.exp(a_end)
            if iv == 0:  # the only programs that store z
                z += tl.sum(k_t * decay[None, :], 1)
    if CARRY:
        _store_chunk_state(S_END + block, Z_END + bh * F + fo, 0, S, z, iv == 0, F, D, BK, BV)


@triton.jit
def _bwd_states_kernel(FQ, LG, DEN, DY, dy_b, dy_h, DDEN, HDS, HDZ, L, H, NT,
                       F: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                       DY_ROW: tl.constexpr, VEC: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, F/BK, D/BV), for the split kernels: dS, dz (gradients w.r.t. the state after each
    chunk, from the later chunks' queries), backward over the chunks into HDS [B*H, NT, F, D], HDZ
    [B*H, NT, F]; a program carries one [BK, BV] block, as in `_fwd_states_kernel`."""
    bh = tl.program_id(0).to(tl.int64)
    fo = tl.program_id(1) * BK
    iv = tl.program_id(2)
    FQ += bh * L * F + fo
    LG += bh * L * F + fo if VEC else bh * L
    DY = _dy_rows(DY, bh, H, dy_b, dy_h) + iv * BV
    DEN += bh * L
    DDEN += bh * L
    HDS += bh * NT * F * D + fo * D + iv * BV
    HDZ += bh * NT * F + fo
    t = tl.arange(0, BT)
    dS = tl.zeros([BK, BV], tl.float32)
    dz = tl.zeros([BK], tl.float32)
    for i in range(NT):
        n = NT - 1 - i
        _store_chunk_state(HDS, HDZ, n, dS, dz, iv == 0, F, D, BK, BV)
        pos = n * BT + t
        A, a_end = _load_gate(LG, pos, L, F, BK, VEC)
        d_num = _load_tile(DY, pos, L, DY_ROW, BV) / tl.load(DEN + pos, mask=pos < L, other=1.0)[:, None]
        d_den = tl.load(DDEN + pos, mask=pos < L, other=0.0)
        dS, dz = _retreat_state_grad(dS, dz, _load_tile(FQ, pos, L, F, BK), A, a_end, d_num, d_den, VEC, DT)


@triton.jit
def _retreat_state_grad(dS, dz, q, A, a_end, d_num, d_den, VEC: tl.constexpr, DT: tl.constexpr):
    """dS, dz carried back over one chunk: decayed across it, plus its queries' gradients."""
    q_dec = q * _q_decay(A, VEC)
    dS = _dot_acc(tl.trans(q_dec), d_num, _decay_state(dS, a_end, VEC), DT)
    dz = dz * tl.exp(a_end) + tl.sum(q_dec * d_den[:, None], 0)
    return dS, dz


@triton.jit
def _state_rows_ptrs(FQ, FK, DF, LG, DA, V, DY, dy_b, dy_h, DEN, DDEN, HS, HZ, bh, ik, L, H, HKV, NT,
                     F: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, VEC: tl.constexpr, CF: tl.constexpr):
    """The dq and dk kernels' pointers for head bh and state rows [ik*BK, (ik+1)*BK): fq, fk and the
    gradient being written (DF) at those features, the gate, the dA share (per feature for a vector
    gate, else [F/BK, B*H, L] partial sums over feature blocks), v, dy, the per-token statistics, and
    the per-chunk state (or state gradient) rows HS, HZ of the split kernels."""
    fo = ik * BK
    kv = (bh // H) * HKV + (bh % H) // (H // HKV)
    if VEC:
        LG += bh * L * F + fo
        DA += bh * L * F + fo
    else:
        LG += bh * L
        if CF:  # the heads' grid axis (`_grid`)
            heads = tl.num_programs(2)
        else:
            heads = tl.num_programs(0)
        DA += (ik * heads + bh) * L
    return (FQ + bh * L * F + fo, FK + bh * L * F + fo, DF + bh * L * F + fo, LG, DA, V + kv * L * D,
            _dy_rows(DY, bh, H, dy_b, dy_h), DEN + bh * L, DDEN + bh * L, HS + bh * NT * F * D + fo * D, HZ + bh * NT * F + fo)


@triton.jit
def _bwd_dq_kernel(FQ, FK, LG, V, DEN, DY, dy_b, dy_h, DDEN, HS, HZ, DFQ, DA_Q, L, H, HKV, NT,
                   F: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, DY_ROW: tl.constexpr,
                   VEC: tl.constexpr, SPLIT: tl.constexpr, CF: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, F/BK[, NT]) (`_grid`), forward over the chunks with state rows [fo, fo+BK) (split: one
    chunk, its state from HS, HZ): d fq of those features and their share of dA = fq.dfq (DA_Q)."""
    bh = _head(CF, 2)
    ik = tl.program_id(1)
    FQ, FK, DFQ, LG, DA_Q, V, DY, DEN, DDEN, HS, HZ = _state_rows_ptrs(
        FQ, FK, DFQ, LG, DA_Q, V, DY, dy_b, dy_h, DEN, DDEN, HS, HZ, bh, ik, L, H, HKV, NT, F, D, BK, VEC, CF)
    t = tl.arange(0, BT)
    rows = tl.arange(0, BK)

    S = _state_before_chunks(HS, BK, D, SPLIT)
    z = tl.zeros([BK], tl.float32)
    first, last = _chunks(NT, SPLIT, CF)
    for n in range(first, last):
        pos = n * BT + t
        inside = pos < L
        if SPLIT:
            S, z = _load_chunk_state(HS, HZ, n, rows, F, D, D)
        q = _load_tile(FQ, pos, L, F, BK)
        k = _load_tile(FK, pos, L, F, BK)
        v = _load_tile(V, pos, L, D, D)
        A, a_end = _load_gate(LG, pos, L, F, BK, VEC)
        d_num = _load_tile(DY, pos, L, DY_ROW, D) / tl.load(DEN + pos, mask=inside, other=1.0)[:, None]
        d_den = tl.load(DDEN + pos, mask=inside, other=0.0)

        # dP_ij = d_num_i . v_j + d_den_i (V with its ones column); decayed, causal.
        dP = _dot(d_num, tl.trans(v), DT) + d_den[:, None]
        if VEC:
            k32 = k.to(tl.float32)
            dq = tl.zeros([BT, BK], tl.float32)
            for j in range(BT):
                dP_j = tl.sum(tl.where(t[None, :] == j, dP, 0.0), 1)  # column j
                dq += dP_j[:, None] * _decays_from(A, t, j) * _row(k32, t, j)[None, :]
        else:
            dq = _dot(dP * _scalar_decay(A, t), k, DT)
        dq += _q_decay(A, VEC) * (_dot(d_num, tl.trans(S), DT) + d_den[:, None] * z[None, :])
        _store_tile(DFQ, pos, L, dq, F, BK)
        # d A_t = fq_t . dfq_t - fk_t . dfk_t: phi and log g enter only as phi e^{+-A}.
        _store_da_share(DA_Q, pos, L, q * dq, F, BK, VEC)
        if not SPLIT:
            S, z = _advance_state(S, z, k, v, A, a_end, VEC, DT)


@triton.jit
def _bwd_dk_kernel(FQ, FK, LG, V, DEN, DY, dy_b, dy_h, DDEN, HDS, HDZ, DFK, DA_K, L, H, HKV, NT,
                   F: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, DY_ROW: tl.constexpr,
                   VEC: tl.constexpr, SPLIT: tl.constexpr, CF: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, F/BK[, NT]) (`_grid`), backward over the chunks with rows [fo, fo+BK) of dS, the
    gradient w.r.t. the state after each chunk (split: one chunk, its dS, dz from HDS, HDZ): d fk of
    those features and their share of dA = -fk.dfk (DA_K)."""
    bh = _head(CF, 2)
    ik = tl.program_id(1)
    FQ, FK, DFK, LG, DA_K, V, DY, DEN, DDEN, HDS, HDZ = _state_rows_ptrs(
        FQ, FK, DFK, LG, DA_K, V, DY, dy_b, dy_h, DEN, DDEN, HDS, HDZ, bh, ik, L, H, HKV, NT, F, D, BK, VEC, CF)
    t = tl.arange(0, BT)
    rows = tl.arange(0, BK)

    dS = _state_before_chunks(HDS, BK, D, SPLIT)
    dz = tl.zeros([BK], tl.float32)
    first, last = _chunks(NT, SPLIT, CF)
    for i in range(first, last):
        n = i if SPLIT else NT - 1 - i
        pos = n * BT + t
        inside = pos < L
        if SPLIT:
            dS, dz = _load_chunk_state(HDS, HDZ, n, rows, F, D, D)
        q = _load_tile(FQ, pos, L, F, BK)
        k = _load_tile(FK, pos, L, F, BK)
        v = _load_tile(V, pos, L, D, D)
        A, a_end = _load_gate(LG, pos, L, F, BK, VEC)
        d_num = _load_tile(DY, pos, L, DY_ROW, D) / tl.load(DEN + pos, mask=inside, other=1.0)[:, None]
        d_den = tl.load(DDEN + pos, mask=inside, other=0.0)

        dP = _dot(d_num, tl.trans(v), DT) + d_den[:, None]
        if VEC:
            q32 = q.to(tl.float32)
            dk = tl.zeros([BT, BK], tl.float32)
            for j in range(BT):
                dP_j = tl.sum(tl.where(t[None, :] == j, dP, 0.0), 1)  # column j
                dk_j = tl.sum(dP_j[:, None] * q32 * _decays_from(A, t, j), 0)
                dk = tl.where((t == j)[:, None], dk_j[None, :], dk)
        else:
            dk = _dot(tl.trans(dP * _scalar_decay(A, t)), q, DT)
        # Through the state: key j reaches every later chunk as fk_j e^{A_end - A_j}.
        k_dec = _k_decay(A, a_end, VEC)
        dk += k_dec * (_dot(v, tl.trans(dS), DT) + dz[None, :])
        _store_tile(DFK, pos, L, dk, F, BK)
        _store_da_share(DA_K, pos, L, -(k * dk), F, BK, VEC)
        if not SPLIT:
            dS, dz = _retreat_state_grad(dS, dz, q, A, a_end, d_num, d_den, VEC, DT)


@triton.jit
def _bwd_dv_kernel(FQ, FK, LG, DEN, DY, dy_b, dy_h, DV_WIN, HDS, DV, L, H, NT,
                   F: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, DY_ROW: tl.constexpr,
                   VEC: tl.constexpr, SPLIT: tl.constexpr, CF: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, D/BV[, NT]) (`_grid`), backward over the chunks with columns [vo, vo+BV) of dS (split:
    one chunk, its dS from HDS): d v of the linear part plus the window's (DV_WIN), per query head."""
    bh = _head(CF, 2)
    vo = tl.program_id(1) * BV
    FQ += bh * L * F
    FK += bh * L * F
    LG += bh * L * (F if VEC else 1)
    DY = _dy_rows(DY, bh, H, dy_b, dy_h) + vo
    DV_WIN += bh * L * D + vo
    DV += bh * L * D + vo
    DEN += bh * L
    HDS += bh * NT * F * D + vo
    t = tl.arange(0, BT)
    rows = tl.arange(0, F)

    dS = _state_before_chunks(HDS, F, BV, SPLIT)
    first, last = _chunks(NT, SPLIT, CF)
    for i in range(first, last):
        n = i if SPLIT else NT - 1 - i
        pos = n * BT + t
        if SPLIT:
            dS = _load_tile(HDS + n * F * D, rows, F, D, BV)
        q = _load_tile(FQ, pos, L, F, F)
        k = _load_tile(FK, pos, L, F, F)
        A, a_end = _load_gate(LG, pos, L, F, F, VEC)
        d_num = _load_tile(DY, pos, L, DY_ROW, BV) / tl.load(DEN + pos, mask=pos < L, other=1.0)[:, None]
        if VEC:
            P = _vector_scores(q.to(tl.float32), k.to(tl.float32), A, t, BT)
        else:
            P = _dot(q, tl.trans(k), DT) * _scalar_decay(A, t)
        dv = _dot_acc(tl.trans(P), d_num, _dot(k * _k_decay(A, a_end, VEC), dS, DT), DT)
        _store_tile(DV, pos, L, dv + _load_tile(DV_WIN, pos, L, D, BV), D, BV)
        if not SPLIT:
            dS = _dot_acc(tl.trans(q * _q_decay(A, VEC)), d_num, _decay_state(dS, a_end, VEC), DT)


@triton.jit
def _bwd_chunk_kernel(FQ, FK, LG, V, DEN, DY, dy_b, dy_h, DDEN, HS, HZ, HDS, HDZ, DV_WIN, DFQ, DFK, DV, DA,
                      L, H, HKV, NT, F: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, DY_ROW: tl.constexpr,
                      GRAD_V: tl.constexpr, CF: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, NT) (`_grid`), split kernels with a scalar gate: one chunk's d fq, d fk and (GRAD_V) d v
    of the linear part plus the window's (DV_WIN), every feature and column in one program, from the
    state at the chunk's start (HS, HZ) and its gradient at the chunk's end (HDS, HDZ). The per-pass
    kernels each form dP = d_num vᵀ + d_den again for every block of features they write (four times
    a chunk at F = 128); here it is formed once and the chunk's tiles are read once. Its dA =
    fq.dfq - fk.dfk goes to DA [B*H, L]."""
    bh = _head(CF, 1)
    n, _ = _row_block(CF)
    kv = (bh // H) * HKV + (bh % H) // (H // HKV)
    t = tl.arange(0, BT)
    rows = tl.arange(0, F)
    pos = n * BT + t
    inside = pos < L
    q = _load_tile(FQ + bh * L * F, pos, L, F, F)
    k = _load_tile(FK + bh * L * F, pos, L, F, F)
    v = _load_tile(V + kv * L * D, pos, L, D, D)
    A, a_end = _load_gate(LG + bh * L, pos, L, F, F, False)
    d_num = _load_tile(_dy_rows(DY, bh, H, dy_b, dy_h), pos, L, DY_ROW, D) / tl.load(
        DEN + bh * L + pos, mask=inside, other=1.0)[:, None]
    d_den = tl.load(DDEN + bh * L + pos, mask=inside, other=0.0)
    decay = _scalar_decay(A, t)
    dP = (_dot(d_num, tl.trans(v), DT) + d_den[:, None]) * decay

    S, z = _load_chunk_state(HS + bh * NT * F * D, HZ + bh * NT * F, n, rows, F, D, D)
    dq = _dot_acc(dP, k, _q_decay(A, False) * (_dot(d_num, tl.trans(S), DT) + d_den[:, None] * z[None, :]), DT)
    _store_tile(DFQ + bh * L * F, pos, L, dq, F, F)
    da = tl.sum(q * dq, 1)

    dS, dz = _load_chunk_state(HDS + bh * NT * F * D, HDZ + bh * NT * F, n, rows, F, D, D)
    k_decay = _k_decay(A, a_end, False)
    dk = _dot_acc(tl.trans(dP), q, k_decay * (_dot(v, tl.trans(dS), DT) + dz[None, :]), DT)
    _store_tile(DFK + bh * L * F, pos, L, dk, F, F)
    tl.store(DA + bh * L + pos, da - tl.sum(k * dk, 1), mask=inside)

    if GRAD_V:
        P = _dot(q, tl.trans(k), DT) * decay
        dv = _dot_acc(tl.trans(P), d_num, _dot(k * k_decay, dS, DT), DT)
        _store_tile(DV + bh * L * D, pos, L, dv + _load_tile(DV_WIN + bh * L * D, pos, L, D, D), D, D)


@triton.jit
def _bwd_window_dq_kernel(QW, KW, V, SINKS, ALPHA, Y_WIN, LSE, DY, dy_b, dy_h, DQW, DELTA, DSINKS, DALPHA, DLSE, ARG, DM,
                          DY_GLA, Y_GLA, DEN, DDEN, DDEN_EXT, L, H, HKV, window, scale,
                          D: tl.constexpr, BW: tl.constexpr, NWB: tl.constexpr, DY_ROW: tl.constexpr, M: tl.constexpr,
                          MP: tl.constexpr, SHARED: tl.constexpr, GRAD_Q: tl.constexpr, NORM: tl.constexpr,
                          CF: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, cdiv(L, BW)) (`_grid`): one block of queries. d qw (GRAD_Q), delta = dy_win . y_win per token
    (DELTA) and this block's share of d sinks and d alpha. SHARED: the log-sum-exp and the row max (held
    by key ARG, or by the largest sinks where ARG < 0) get gradients DLSE and DM of their own. Without
    GRAD_Q (stage 1: qw is RoPE of a frozen projection) no window scores are recomputed: delta and the
    sinks' and alpha's gradients need only the saved outputs and log-sum-exps.

    Also the linear part's per-token d den = -dy_gla . y_gla / den (NORM; SHARED adds the gradient den
    gets through the shared normaliser, DDEN_EXT) into DDEN: the linear part's kernels all read it, and
    the backward's state pass needs it before they run. DY_GLA is DY (not SHARED) or laid out as it."""
    bh = _head(CF, 1)
    n, blocks = _row_block(CF)
    h = bh % H
    kv = (bh // H) * HKV + h // (H // HKV)
    part = bh * blocks + n
    QW += bh * L * D
    DQW += bh * L * D
    DY = _dy_rows(DY, bh, H, dy_b, dy_h)
    Y_WIN += bh * L * D
    KW += kv * L * D
    V += kv * L * D
    pos = n * BW + tl.arange(0, BW)
    inside = pos < L
    alpha = tl.load(ALPHA + h).to(tl.float32)
    lse = tl.load(LSE + bh * L + pos, mask=inside, other=float("inf"))  # padded rows: zero probabilities
    dy = _load_tile(DY, pos, L, DY_ROW, D)
    dy_ywin = tl.sum(dy.to(tl.float32) * _load_tile(Y_WIN, pos, L, D, D).to(tl.float32), 1)
    d_den = tl.zeros([BW], tl.float32)
    if NORM:
        dy_gla = _load_tile(_dy_rows(DY_GLA, bh, H, dy_b, dy_h), pos, L, DY_ROW, D) if SHARED else dy
        y_gla = _load_tile(Y_GLA + bh * L * D, pos, L, D, D)
        d_den -= tl.sum(dy_gla.to(tl.float32) * y_gla.to(tl.float32), 1) / tl.load(DEN + bh * L + pos, mask=inside,
                                                                                    other=1.0)
    if SHARED:
        d_den += tl.load(DDEN_EXT + bh * L + pos, mask=inside, other=0.0)
    tl.store(DDEN + bh * L + pos, d_den, mask=inside)
    delta = alpha * dy_ywin
    if SHARED:  # d lse_i reaches s_ij as p_ij d lse_i: the same as lowering delta
        delta -= tl.load(DLSE + bh * L + pos, mask=inside, other=0.0)
    tl.store(DELTA + bh * L + pos, delta, mask=inside)
    tl.store(DALPHA + part, tl.sum(dy_ywin, 0))

    if SHARED:
        arg = tl.load(ARG + bh * L + pos, mask=inside, other=-1)
        dm = tl.load(DM + bh * L + pos, mask=inside, other=0.0)
    if GRAD_Q:
        qw = _load_tile(QW, pos, L, D, D)
        dy_win = alpha * dy
        dqw = tl.zeros([BW, D], tl.float32)
        for mb in range(tl.maximum(n - NWB, 0), n + 1):
            kpos = mb * BW + tl.arange(0, BW)
            kw = _load_tile(KW, kpos, L, D, D)
            p = tl.exp(_window_scores(qw, kw, pos, kpos, window, scale, DT) - lse[:, None])
            dp = _dot(dy_win, tl.trans(_load_tile(V, kpos, L, D, D)), DT)
            dqw = _dot_acc(p * (dp - delta[:, None]), kw, dqw, DT)
        if SHARED:  # the row max's gradient goes to the one logit that holds it: q_i . k_arg
            k_arg = tl.load(KW + arg[:, None] * D + tl.arange(0, D)[None, :], mask=(arg >= 0)[:, None], other=0.0)
            dqw += dm[:, None] * k_arg.to(tl.float32)
        _store_tile(DQW, pos, L, dqw * scale, D, D)
    if M > 0:  # sinks carry no value: d t_m = -sum_i p_im delta_i
        sinks = _sink_logits(SINKS + h * M, M, MP)
        d_sinks = -tl.sum(tl.exp(sinks[None, :] - lse[:, None]) * delta[:, None], 0)
        if SHARED:  # rows whose max is a sink: split among the sinks tied at the top, as torch.amax does
            top = sinks == tl.max(sinks, 0)
            share = top.to(tl.float32) / tl.sum(top.to(tl.float32), 0)
            d_sinks += tl.sum(tl.where(arg < 0, dm, 0.0), 0) * share
        tl.store(DSINKS + part * MP + tl.arange(0, MP), d_sinks)


@triton.jit
def _bwd_window_dkv_kernel(QW, KW, V, ALPHA, LSE, DY, dy_b, dy_h, DELTA, ARG, DM, DKW, DV_WIN, L, H, HKV, window, scale,
                           D: tl.constexpr, BW: tl.constexpr, NWB: tl.constexpr, DY_ROW: tl.constexpr, SHARED: tl.constexpr,
                           CF: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, cdiv(L, BW)) (`_grid`): one block of keys, seen by the query blocks n .. n + NWB. d kw
    and the window's d v, per query head (SHARED: plus the row max's gradient DM where key ARG holds it)."""
    bh = _head(CF, 1)
    n, blocks = _row_block(CF)
    h = bh % H
    kv = (bh // H) * HKV + h // (H // HKV)
    QW += bh * L * D
    DY = _dy_rows(DY, bh, H, dy_b, dy_h)
    pos = n * BW + tl.arange(0, BW)
    kw = _load_tile(KW + kv * L * D, pos, L, D, D)
    v = _load_tile(V + kv * L * D, pos, L, D, D)
    alpha = tl.load(ALPHA + h).to(tl.float32)

    dkw = tl.zeros([BW, D], tl.float32)
    dv = tl.zeros([BW, D], tl.float32)
    for qb in range(n, tl.minimum(n + NWB, blocks - 1) + 1):
        qpos = qb * BW + tl.arange(0, BW)
        q_in = qpos < L
        qw = _load_tile(QW, qpos, L, D, D)
        dy_win = alpha * _load_tile(DY, qpos, L, DY_ROW, D)
        lse = tl.load(LSE + bh * L + qpos, mask=q_in, other=float("inf"))
        delta = tl.load(DELTA + bh * L + qpos, mask=q_in, other=0.0)
        p = tl.exp(_window_scores(qw, kw, qpos, pos, window, scale, DT) - lse[:, None])
        dv = _dot_acc(tl.trans(p), dy_win, dv, DT)
        ds = p * (_dot(dy_win, tl.trans(v), DT) - delta[:, None])
        if SHARED:
            arg = tl.load(ARG + bh * L + qpos, mask=q_in, other=-1)
            dm = tl.load(DM + bh * L + qpos, mask=q_in, other=0.0)
            ds += tl.where(arg[:, None] == pos[None, :], dm[:, None], 0.0)
        dkw = _dot_acc(tl.trans(ds), qw, dkw, DT)
    _store_tile(DKW + bh * L * D, pos, L, dkw * scale, D, D)
    _store_tile(DV_WIN + bh * L * D, pos, L, dv, D, D)


# ----------------------------------------------------------------------------------------------------
# Launch


def supports(fq, fk, log_g, qw, kw, v, *, window, sinks, dtype=None) -> str | None:
    """None when the kernels handle these inputs, else the reason they do not. `dtype`: the one dtype
    that fq, fk, qw, kw, v will be cast to before the kernels (None: they go as they are)."""
    if not (fq.is_cuda or (INTERPRET and fq.device.type == "cpu")):
        return f"device {fq.device.type}"
    if len({t.device for t in (fq, fk, log_g, qw, kw, v)}) != 1:
        return "inputs on several devices"
    dtypes = {dtype} if dtype is not None else {t.dtype for t in (fq, fk, qw, kw, v)}
    if len(dtypes) != 1 or not dtypes <= DOT_DTYPES.keys():
        return "fq, fk, qw, kw, v must share one dtype: float32, bfloat16 or float16"
    if fq.shape[2] == 0:
        return "empty sequence"
    F, D = fq.shape[-1], qw.shape[-1]
    for name, n in (("feature dim", F), ("head dim", D)):
        if n not in (16, 32, 64, 128):
            return f"{name} {n} not in 16/32/64/128"
    if fq.is_cuda and miscompiled_on_gpu(F, D, next(iter(dtypes))):
        return f"head dim {D} under {F} features in 16 bits: the GPU build of the forward is wrong there"
    if log_g.shape[-1] not in (1, F):
        return "gate must be [B,H,L,1] or [B,H,L,F]"
    if kw.shape[1] == 0 or fq.shape[1] % kw.shape[1] != 0:
        return "query heads must be a multiple of the KV heads"
    if window < 1:
        return "window < 1"
    if sinks is not None and sinks.shape[-1] > MAX_SINKS:
        return f"more than {MAX_SINKS} sinks"
    return None


def miscompiled_on_gpu(F: int, D: int, dtype: torch.dtype) -> bool:
    """Shapes whose forward Triton (3.6, sm_90) compiles wrongly: a head dim of 16 under more features,
    in 16 bits. On the H200 (docs/kernels.md "Known limitations") bf16 at D = 16
    read shared memory out of range (F = 32: an illegal address, through tensor descriptors or pointer
    loads) or gave y at 0.34 relative error (F = 32 in the one-pass kernel, F = 64); F = D = 16,
    F = D = 32 and float32 were right. The interpreter is right at all of them. float16, not measured,
    builds the same tiles and is refused with bf16."""
    return D == 16 and F > D and dtype in (torch.bfloat16, torch.float16)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device, looked up once: every forward and backward asks (an H200's 132 for the
    interpreter on CPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _state_blocks(heads: int, F: int, D: int, rows: int, cfg: Config, device: torch.device) -> tuple[int, int]:
    """State rows (at most `rows`) and value columns per program of a sequential state pass
    (`_fwd_states_kernel`, `_bwd_states_kernel`): each program walks every chunk, so with few heads
    (batch 1 at long context: 32 programs for 132 SMs) narrower column blocks, down to 32, give more
    programs."""
    sms = _multiprocessors(device)
    BK, BV = min(rows, F), min(cfg.state_block_v, D)
    while BV > 32 and heads * (F // BK) * (D // BV) < sms:
        BV //= 2
    return BK, BV


def _grid(cfg: Config, heads: int, middle: tuple, blocks: int | None) -> tuple:
    """A launch grid: (heads, *middle, blocks), or (blocks, *middle, heads) with `cfg.chunks_first`
    (the kernels find their axes with `_head`, `_chunks` and `_row_block`); (heads, *middle) where
    the kernel walks every chunk itself (blocks None)."""
    if blocks is None:
        return (heads, *middle)
    return (blocks, *middle, heads) if cfg.chunks_first else (heads, *middle, blocks)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Whether tensor descriptors are copied by a tensor memory accelerator: Hopper and later, or
    Triton's interpreter (which copies them as the hardware would, zero-filling past the end). Looked
    up once a device: every forward asks before its first launch."""
    return INTERPRET or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def _descriptors(fq, fk, qw, kw, v, hs, BT: int, BV: int) -> tuple:
    """The forward's tiled inputs as tensor descriptors (`_head_rows`): [heads, L, width] views whose
    [1, BT, width] tiles end at each head's last row, and the chunk states [B*H*NT, F, D]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def rows(x, width):
        return TensorDescriptor.from_tensor(x.view(-1, x.shape[-2], x.shape[-1]), [1, BT, width])

    F, D = fq.shape[-1], qw.shape[-1]
    states = TensorDescriptor.from_tensor(hs.view(-1, F, D), [1, F, BV]) if hs.dim() == 4 else hs
    return rows(fq, F), rows(fk, F), rows(qw, D), rows(kw, D), rows(v, BV), states


def _state_dtype(dtype: torch.dtype, vec: bool) -> torch.dtype:
    """The split kernels' chunk states. A vector gate's d log g is a reverse cumsum over the sequence of
    per-feature terms that cancel, so it keeps the states (and the backward's linear-part products) in
    float32: in bf16 its error grew with L to 1.46e-2 at L = 600 (float32 here: 5e-3 at L = 300, in the
    interpreter). The scalar gate sums F features per term and stays at 4e-3 with bf16 states."""
    return torch.float32 if vec else dtype


def _forward(fq, fk, log_g, qw, kw, v, sinks, alpha, window, scale, eps, normalize, cfg, save, shared=False,
             carried=None, head=0):
    """Launch the forward; returns the inputs made contiguous, the output, what the backward needs
    (y_gla, y_win, den, lse and, with `shared`, each row's window max and the key holding it), the
    split kernels' chunk states and, given `carried` (S [B, H, F, D], z [B, H, F] float32: the linear
    state of earlier tokens, which the linear part then continues), the state after the last token.
    Without `save`, the parts are the first `head` rows' y_win, den, lse and window max (none at 0)."""
    if carried is not None and not cfg.split:
        cfg = dataclasses.replace(cfg, split=True)  # the state pass is what starts from the carried state
    fq, fk, log_g, qw, kw, v, alpha = (t.contiguous() for t in (fq, fk, log_g, qw, kw, v, alpha))
    sinks = None if sinks is None or sinks.shape[-1] == 0 else sinks.contiguous()
    B, H, L, F = fq.shape
    D = qw.shape[-1]
    vec = log_g.shape[-1] != 1
    BT = VECTOR_GATE_CHUNK if vec else cfg.chunk
    BV = min(cfg.block_v, D)
    M = 0 if sinks is None else sinks.shape[-1]
    MP = max(2, triton.next_power_of_2(M))
    HKV, DT = kw.shape[1], DOT_DTYPES[fq.dtype]
    NT = triton.cdiv(L, BT)
    shapes = {"F": F, "D": D, "BV": BV, "BT": BT, "VEC": vec, "DT": DT, "num_warps": cfg.warps,
              "num_stages": cfg.stages}
    end = None
    tma = cfg.tma and _has_tma(qw.device)
    # The state pass launches first, so that the GPU starts on it while the host allocates the rest.
    if cfg.split:
        hs = torch.empty(B * H, NT, F, D, device=qw.device, dtype=_state_dtype(fq.dtype, vec))
        hz = torch.empty(B * H, NT, F, device=qw.device, dtype=torch.float32)
        s0, z0 = (t.float().contiguous() for t in carried) if carried is not None else (hz, hz)
        if carried is not None:
            end = torch.empty(B, H, F, D, device=qw.device, dtype=torch.float32), torch.empty_like(z0)
        s_end, z_end = end if end is not None else (hz, hz)
        BKS, BVS = _state_blocks(B * H, F, D, cfg.state_block_k, cfg, qw.device)
        grid = (B * H * (F // BKS) * (D // BVS),)
        _fwd_states_kernel[grid](fk, log_g, v, hs, hz, s0, z0, s_end, z_end, L, H, HKV, NT, CARRY=carried is not None,
                                 BK=BKS, **(shapes | {"BV": BVS, "num_warps": cfg.state_warps,
                                                      "num_stages": cfg.state_stages}))
    # y as [B, L, H, d] in memory, returned as its [B, H, L, d] view: the model's transpose back to
    # [B, L, H d] for o_proj is then a view, and in training its gradient reaches the backward's
    # shared split without a copy.
    y = torch.empty(B, L, H, D, device=qw.device, dtype=qw.dtype).transpose(1, 2)
    # The backward splits dy between the branches with these (input dtype, as flash attention's O).
    head = 0 if save else min(head, L)
    y_gla = torch.empty_like(qw) if save else y
    y_win = torch.empty_like(qw) if save else torch.empty(B, H, head, D, device=qw.device, dtype=qw.dtype)
    den = torch.empty(B, H, L if save else head, device=qw.device, dtype=torch.float32)
    lse = torch.empty_like(den)
    # Written only with `shared` (and `save`), or for the head rows: each row's window max (sinks
    # included) and its key (-1: a sink).
    row_max = torch.empty_like(den) if (shared and save) or head else den
    arg = torch.empty(B, H, L, device=qw.device, dtype=torch.int32) if shared and save else den
    if not cfg.split:
        hs = hz = den  # unread
    fq_t, fk_t, qw_t, kw_t, v_t, hs_t = (_descriptors(fq, fk, qw, kw, v, hs, BT, BV) if tma
                                         else (fq, fk, qw, kw, v, hs))
    _fwd_kernel[_grid(cfg, B * H, (D // BV,), NT if cfg.split else None)](
        fq_t, fk_t, log_g, qw_t, kw_t, v_t, alpha if sinks is None else sinks, alpha, hs_t, hz, y, y_gla, y_win, den,
        lse, row_max, arg, L, H, HKV, NT, window, scale, eps, head, NWB=triton.cdiv(window - 1, BT), M=M, MP=MP,
        SAVE=save, KEEP_HEAD=head > 0,
        SPLIT=cfg.split, NORM=normalize, SHARED=shared, CF=cfg.chunk_axis_first, TMA=tma,
        **(shapes | {"num_stages": cfg.forward_stages, "maxnreg": cfg.forward_registers if tma else None}))
    inputs = (fq, fk, log_g, qw, kw, v, sinks, alpha)
    parts = ((y_gla, y_win, den, lse) + ((row_max, arg) if shared else ()) if save
             else (y_win, den, lse, row_max))
    return inputs, y, parts, ((hs, hz) if cfg.split else ()), end


class LizardAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fq, fk, log_g, qw, kw, v, sinks, alpha, window, scale, eps, normalize, cfg, save, shared):
        inputs, y, parts, states, _ = _forward(fq, fk, log_g, qw, kw, v, sinks, alpha, window, scale, eps,
                                               normalize, cfg, save, shared)
        if save:
            ctx.save_for_backward(*inputs, *parts, *states)
            ctx.window, ctx.scale, ctx.normalize, ctx.cfg, ctx.shared = window, scale, normalize, cfg, shared
        return y

    @staticmethod
    def backward(ctx, dy):
        shared = ctx.shared
        fq, fk, log_g, qw, kw, v, sinks, alpha, y_gla, y_win, den, lse, *rest = ctx.saved_tensors
        row_max, arg, states = (rest[0], rest[1], rest[2:]) if shared else (den, den, rest)
        cfg, window, scale = ctx.cfg, ctx.window, ctx.scale
        dlse = dm = dden_ext = den  # unread unless shared
        if shared:  # the split reads dy as it comes (the model's [B, L, H d] gradient, viewed), no copy
            dy_gla, dy_win, dlse, dm, dden_ext = shared_split(dy, y_gla, y_win, den, lse, row_max)
            alpha = torch.ones_like(alpha)  # the window kernels scale dy by alpha: dy_win is already scaled
        else:  # read as it comes: the model's [B, L, H, D] gradient, transposed, is not copied
            dy_gla = dy_win = dy if dy.stride(-1) == 1 else dy.contiguous()
        B, H, L, F = fq.shape
        HKV, D = kw.shape[1], kw.shape[-1]
        group = H // HKV
        vec = log_g.shape[-1] != 1
        BT = VECTOR_GATE_CHUNK if vec else cfg.chunk
        BK, BV = min(cfg.block_k, F), min(cfg.dv_block_v, D)
        BWQ, BWKV = cfg.window_dq_block, cfg.window_dkv_block
        NW = triton.cdiv(L, BWQ)  # the dq pass's row blocks, each writing its share of d sinks and d alpha
        M = 0 if sinks is None else sinks.shape[-1]
        MP = max(2, triton.next_power_of_2(M))
        dev, f32 = fq.device, torch.float32
        NT = triton.cdiv(L, BT)
        split = {"SPLIT": cfg.split, "BT": BT, "VEC": vec, "DT": DOT_DTYPES[_state_dtype(fq.dtype, vec)],
                 "DY_ROW": dy_gla.stride(2), "num_warps": cfg.warps, "num_stages": cfg.stages}
        state = {key: value for key, value in split.items() if key != "SPLIT"}
        split["CF"] = cfg.chunk_axis_first
        chunks = NT if cfg.split else None
        win = {"D": D, "DT": DOT_DTYPES[fq.dtype], "DY_ROW": dy_win.stride(2), "CF": cfg.chunks_first,
               "num_warps": cfg.warps, "num_stages": cfg.stages}
        win_dq = win | {"BW": BWQ, "NWB": triton.cdiv(window - 1, BWQ)}
        win_dkv = win | {"BW": BWKV, "NWB": triton.cdiv(window - 1, BWKV)}
        dy_gla_bh, dy_win_bh = (dy_gla.stride(0), dy_gla.stride(1)), (dy_win.stride(0), dy_win.stride(1))

        # Stage 1 trains the feature maps, gate, sinks and alpha only: qw, kw (RoPE of frozen projections)
        # and v need no gradient, and the window's d k / d v passes and the linear part's d v are skipped.
        grad_qw, grad_kw, grad_v = ctx.needs_input_grad[3:6]
        window_kv = grad_kw or grad_v  # the window's d k / d v pass writes both
        dfq, dfk = torch.empty_like(fq), torch.empty_like(fk)
        dqw = torch.empty_like(qw) if grad_qw else den  # den: a placeholder the kernel does not touch
        # Per query head; float32 where a GQA group is summed afterwards.
        kv_dtype = kw.dtype if group == 1 else f32
        dkw = torch.empty(B, H, L, D, device=dev, dtype=kv_dtype) if window_kv else den
        dv = torch.empty(B, H, L, D, device=dev, dtype=kv_dtype) if grad_v else den
        dv_win = torch.empty(B, H, L, D, device=dev, dtype=f32) if window_kv else den
        fused = cfg.fuses_backward(vec)
        # dA shares: per feature (vector gate), else partial sums: one from the fused kernel, or one per
        # feature block of the dq pass and then of the dk pass.
        shares = 1 if fused else 2 * (F // BK)
        da = torch.empty((2, B, H, L, F) if vec else (shares, B, H, L), device=dev, dtype=f32)
        d_den, delta = torch.empty_like(den), torch.empty_like(den)
        d_sinks = torch.empty(B * H * NW, MP, device=dev, dtype=f32)
        d_alpha = torch.empty(B * H * NW, device=dev, dtype=f32)

        # First the per-token terms: the window's delta and the linear part's d den, which all the
        # linear part's passes read.
        _bwd_window_dq_kernel[_grid(cfg, B * H, (), NW)](
            qw, kw, v, alpha if sinks is None else sinks, alpha, y_win, lse, dy_win, *dy_win_bh, dqw, delta, d_sinks,
            d_alpha, dlse, arg, dm, dy_gla, y_gla, den, d_den, dden_ext, L, H, HKV, window, scale, M=M, MP=MP,
            SHARED=shared, GRAD_Q=grad_qw, NORM=ctx.normalize, **win_dq)
        if window_kv:
            _bwd_window_dkv_kernel[_grid(cfg, B * H, (), triton.cdiv(L, BWKV))](
                qw, kw, v, alpha, lse, dy_win, *dy_win_bh, delta, arg, dm, dkw, dv_win, L, H, HKV, window, scale,
                SHARED=shared, **win_dkv)
        hs, hz = states if cfg.split else (den, den)  # unread unless split
        if cfg.split:
            hds = torch.empty(B * H, NT, F, D, device=dev, dtype=_state_dtype(fq.dtype, vec))
            hdz = torch.empty(B * H, NT, F, device=dev, dtype=f32)
            BKS, BVS = _state_blocks(B * H, F, D, cfg.dstate_block_k, cfg, dev)
            _bwd_states_kernel[(B * H, F // BKS, D // BVS)](fq, log_g, den, dy_gla, *dy_gla_bh, d_den, hds, hdz, L, H,
                                                            NT, F=F, D=D, BK=BKS, BV=BVS, **state)
        else:
            hds = hdz = den
        if fused:
            _bwd_chunk_kernel[_grid(cfg, B * H, (), NT)](
                fq, fk, log_g, v, den, dy_gla, *dy_gla_bh, d_den, hs, hz, hds, hdz, dv_win, dfq, dfk, dv, da, L, H,
                HKV, NT, F=F, D=D, BT=BT, DY_ROW=split["DY_ROW"], GRAD_V=grad_v, CF=cfg.chunks_first,
                DT=split["DT"], num_warps=cfg.warps, num_stages=cfg.stages)
        else:
            da_q, da_k = da.chunk(2)  # each pass's half of the shares
            _bwd_dq_kernel[_grid(cfg, B * H, (F // BK,), chunks)](
                fq, fk, log_g, v, den, dy_gla, *dy_gla_bh, d_den, hs, hz, dfq, da_q, L, H, HKV, NT, F=F, D=D, BK=BK,
                **split)
            _bwd_dk_kernel[_grid(cfg, B * H, (F // BK,), chunks)](
                fq, fk, log_g, v, den, dy_gla, *dy_gla_bh, d_den, hds, hdz, dfk, da_k, L, H, HKV, NT, F=F, D=D, BK=BK,
                **split)
            if grad_v:
                _bwd_dv_kernel[_grid(cfg, B * H, (D // BV,), chunks)](
                    fq, fk, log_g, den, dy_gla, *dy_gla_bh, dv_win, hds, dv, L, H, NT, F=F, D=D, BV=BV, **split)

        # d log g_t = sum over s >= t of dA_s.
        if vec:
            d_log_g = da.sum(0).flip(2).cumsum(2).flip(2)
        else:
            d_log_g = scalar_gate_grad(da)[..., None]
        dqw = dqw if grad_qw else None
        dkw = (dkw.view(B, HKV, group, L, D).sum(2).to(kw.dtype) if group > 1 else dkw) if grad_kw else None
        dv = (dv.view(B, HKV, group, L, D).sum(2).to(v.dtype) if group > 1 else dv) if grad_v else None
        dsinks = None if sinks is None else d_sinks.view(B, H, NW, MP).sum((0, 2))[:, :M].to(sinks.dtype)
        dalpha = None if shared else d_alpha.view(B, H, NW).sum((0, 2)).to(alpha.dtype)
        return (dfq, dfk, d_log_g.to(log_g.dtype), dqw, dkw, dv, dsinks, dalpha) + (None,) * 7


GATE_GRAD_BLOCK = 1024  # tokens per step of `_scalar_gate_grad_kernel`'s scan


@triton.jit
def _scalar_gate_grad_kernel(DA, DLG, R, L, NB: tl.constexpr, BL: tl.constexpr):
    """Grid (R,), a program per head and batch row: d log g of its L tokens, the reverse cumsum of the
    dA shares ([NB, R, L]: partial sums of the dq and dk passes over their feature blocks), in blocks
    of BL tokens from the end, carrying the sum of the blocks after."""
    r = tl.program_id(0).to(tl.int64)
    carry = tl.zeros([], tl.float32)
    for i in range(tl.cdiv(L, BL)):
        pos = L - (i + 1) * BL + tl.arange(0, BL)
        inside = pos >= 0
        x = tl.zeros([BL], tl.float32)
        for nb in tl.static_range(NB):
            x += tl.load(DA + (nb * R + r) * L + pos, mask=inside, other=0.0)
        tl.store(DLG + r * L + pos, tl.cumsum(x, 0, reverse=True) + carry, mask=inside)
        carry += tl.sum(x, 0)


def scalar_gate_grad(da):
    """d log g [B, H, L] of a scalar gate from the backward's dA shares ([NB, B, H, L] float32): the sum
    over s >= t, summed over the NB shares, in one kernel (in PyTorch: two sums, an add, two flips and
    a cumsum, six launches a layer in training)."""
    NB, B, H, L = da.shape
    out = torch.empty(B, H, L, device=da.device, dtype=torch.float32)
    _scalar_gate_grad_kernel[(B * H,)](da, out, B * H, L, NB=NB, BL=min(GATE_GRAD_BLOCK, triton.next_power_of_2(L)),
                                       num_warps=4)
    return out


SPLIT_ROWS = 32  # rows (tokens of a head) per program of `_shared_split_kernel`


@triton.jit
def _shared_split_kernel(dy, y_gla, y_win, den, lse, row_max, dy_gla, dy_win, dlse, dm, dden, R, H, L,
                         s_b, s_h, s_l, D: tl.constexpr, BR: tl.constexpr):
    """Grid (cdiv(R, BR),) over the R = B*H*L rows of contiguous [., D] and [.] tensors (dy: [B, H, L, D]
    with strides s_b, s_h, s_l and unit columns): `shared_split_reference` in one pass (read dy and
    both branches' outputs once, write the two float32 dy's and three row terms)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    live = rows < R
    cols = tl.arange(0, D)[None, :]
    at = rows[:, None] * D + cols
    dy_at = ((rows // (H * L)) * s_b + (rows // L % H) * s_h + rows % L * s_l)[:, None] + cols
    g_y = tl.load(dy + dy_at, mask=live[:, None], other=0.0).to(tl.float32)
    y_g = tl.load(y_gla + at, mask=live[:, None], other=0.0).to(tl.float32)
    y_w = tl.load(y_win + at, mask=live[:, None], other=0.0).to(tl.float32)
    n = tl.load(den + rows, mask=live, other=1.0)
    share = tl.exp(tl.load(lse + rows, mask=live, other=0.0) - tl.load(row_max + rows, mask=live, other=0.0))
    c = share / (share + n)
    g = c * (1 - c) * tl.sum(g_y * (y_w - y_g), axis=1)
    tl.store(dy_gla + at, (1 - c)[:, None] * g_y, mask=live[:, None])
    tl.store(dy_win + at, c[:, None] * g_y, mask=live[:, None])
    tl.store(dlse + rows, g, mask=live)
    tl.store(dm + rows, -g, mask=live)
    tl.store(dden + rows, -g / n, mask=live)


def shared_split(dy, y_gla, y_win, den, lse, row_max):
    """`shared_split_reference` through `_shared_split_kernel`: one pass instead of ~10 PyTorch passes
    over [B, H, L, D] (the shared normaliser's forward+backward cost ~45% more than the alpha mix's
    with them, docs/kernels.md). dy [B, H, L, D] in any layout with contiguous columns, the rest
    contiguous; same outputs (contiguous)."""
    _, H, L, D = dy.shape
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    R = dy.numel() // D
    dy_gla, dy_win = (torch.empty(dy.shape, device=dy.device, dtype=torch.float32) for _ in range(2))
    dlse, dm, dden = torch.empty_like(den), torch.empty_like(den), torch.empty_like(den)
    _shared_split_kernel[(triton.cdiv(R, SPLIT_ROWS),)](dy, y_gla, y_win, den, lse, row_max, dy_gla, dy_win, dlse,
                                                        dm, dden, R, H, L, dy.stride(0), dy.stride(1), dy.stride(2),
                                                        D=D, BR=SPLIT_ROWS, num_warps=4)
    return dy_gla, dy_win, dlse, dm, dden


def shared_split_reference(dy, y_gla, y_win, den, lse, row_max):
    """The shared normaliser's backward, before the kernels: y = c y_win + (1 - c) y_gla with the window's
    share c = l / (l + den), l = e^(lse - max) its softmax sum relative to the row max (sinks included).
    Returns dy_gla = (1 - c) dy and dy_win = c dy (float32) for the two branches' kernels, and the
    gradients that c passes to lse, to the row max and to den: g, -g and -g / den,
    g = c (1 - c) dy.(y_win - y_gla)."""
    c = (lse - row_max).exp()
    c = c / (c + den)
    dyf = dy.float()
    g = c * (1 - c) * (dyf * (y_win.float() - y_gla.float())).sum(-1)
    return (1 - c)[..., None] * dyf, c[..., None] * dyf, g, -g, -g / den


def lizard_attention_triton(fq, fk, log_g, qw, kw, v, options: GlaWindowOptions, *, config=None):
    """The fused kernels over a fresh pass (`linearize.ops.chunk_gla_window`'s Triton implementation;
    inputs already checked by `supports`, beta folded into fq)."""
    if options.shared and not options.normalize:
        raise ValueError("shared=True needs normalize=True (one normaliser for both branches)")
    if options.beta != 1.0:
        raise ValueError("the kernels take beta = 1 (scale fq instead)")
    tensors = (fq, fk, log_g, qw, kw, v, options.sinks, options.alpha)
    # Keep what the backward needs only when there will be one (not under no_grad / inference).
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    scalars = (int(options.window), float(options.scale), float(options.eps), bool(options.normalize),
               config or Config.default(fq.dtype), save, bool(options.shared))
    if not save:  # no backward: skip the autograd Function's bookkeeping, host time before the first launch
        return _forward(*tensors, *scalars)[1]
    return LizardAttentionFunction.apply(*tensors, *scalars)


@torch.no_grad()
def lizard_attention_head(fq, fk, log_g, qw, kw, v, options: GlaWindowOptions, *, head, carried=None, config=None):
    """The forward's output y [B, H, L, d] (a view of [B, L, H, d] memory) and, for its first `head` rows
    (at most L), the branches' parts before they were mixed: y_win [B, H, head, d] (inputs' dtype), the
    linear part's denominator (eps included), the window's log-sum-exp and its row max (sinks included),
    float32 [B, H, head]. Given `carried` (S, z of earlier tokens), the linear part continues that
    state, and the state after the last token follows. Normalised, beta = 1."""
    _, y, parts, _, end = _forward(fq, fk, log_g, qw, kw, v, options.sinks, options.alpha, int(options.window),
                                   float(options.scale), float(options.eps), True, config or Config.default(fq.dtype),
                                   False, bool(options.shared), carried, int(head))
    return (y, parts) + ((end,) if carried is not None else ())
