"""STILL's prefill on paper: FLOPs and bytes per token, the fused kernel of today against the chunked
form, next to SDPA's and the GEMM floor's (pure arithmetic: nothing runs on a device).

    PYTHONPATH=. python -m experiments.still.roofline [--shape llama3-8b] [--contexts 16k,128k]

The model is a `linearize.bench.shapes` shape (layers, widths, heads), STILL's options `StillConfig`'s
defaults (window W, budget, routing chunk, features F = head_dim), the prefill the one `bench model`
times: a linear model in calls of `prefill_chunk` tokens continuing its cache, the softmax teacher in
one forward. Per token, summed over the layers, operands 16-bit (BYTES), STILL's linear state float32.
Two byte counts: `bytes`, every input and output once (the least any kernel moves), and `streamed`,
every tile each program reads or writes with no reuse between programs (what HBM serves when no
cache helps).

  GEMM floor  q, k, v, o and the MLP: 2 x their weights' entries in FLOPs; bytes: each GEMM's input
              and output, plus the weights once a call, shared by the call's tokens.
  SDPA        causal flash attention over the context: 4 d FLOPs per (query, key) pair and query head;
              bytes q, k, v, o; streamed: each program of SDPA_QUERIES queries reads the keys and values
              up to it.
  STILL, O(L^2) kernel  `ops.still.triton._fwd_kernel` as the prefill runs it: each call in blocks of
              KERNEL_BLOCK tokens, the first fresh, each next one continuing the state, over P = K + W - 1
              carried keys (and P zero query rows) before its n new ones, so (P + n)^2 / 2 pairs. Per pair
              and query head q.k, p v, fq.fk, lam v: (6 d + 2 F) FLOPs; bytes q, fq, the gate, y for every
              row walked, k, v, fk, the fold times; streamed: each program of STILL_QUERIES queries
              reads k, v, fk, the fold time and validity of the keys up to it.
  STILL, chunked  `ops.still.chunked` as a kernel would run it (blocks of C queries): softmax over
              N = K + W + C - 1 keys a block, every slot held (4 d N FLOPs a query; fewer while the
              slots fill), the C fold events read causally
              (2 C (F + d)), the state read (2 F d + 2 F) and updated (2 F d: a block's [F, C] x [C, d]
              product over C tokens); bytes as the O(L^2) kernel's for the new rows only; streamed: each
              block reads its N keys and values, its fold events' fk and v, its salient list, and
              writes and reads the state once (float32; a kernel carrying it on chip saves that).
  STILL extras  what both STILL forms add to the floor: the gate's projection, the feature maps (a d x F/2
              map per query head for q and for each query head's k), the routing's banded saliency
              (each query over 2 x the routing chunk keys).

Bound: max(FLOPs / PEAK_FLOPS, bytes / PEAK_BYTES) at an H100 SXM's datasheet peaks (dense bf16
tensor cores, HBM3), a floor no kernel beats; the prefill's bound is that per token times the context.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

BYTES = 2  # bf16 operands
STATE_BYTES = 4  # float32 linear state
PEAK_FLOPS = 989e12  # H100 SXM, dense bf16 tensor cores (datasheet)
PEAK_BYTES = 3.35e12  # H100 SXM, HBM3 (datasheet)
SDPA_QUERIES = 128  # queries a flash-attention program: its keys and values are read once per program
STILL_QUERIES = 64  # queries a program of STILL's fused kernel (`triton.block_size` at 16-bit d <= 64)


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_shape(cls, name: str) -> Model:
        from linearize.bench.shapes import SHAPES

        config = SHAPES[name].config
        heads = config["num_attention_heads"]
        return cls(layers=config["num_hidden_layers"], hidden=config["hidden_size"],
                   intermediate=config["intermediate_size"], heads=heads, kv_heads=config["num_key_value_heads"],
                   head_dim=config.get("head_dim", config["hidden_size"] // heads))


@dataclass(frozen=True)
class Still:
    window: int
    slots: int
    routing_chunk: int
    features: int
    block: int  # the chunked form's queries a block (C)
    kernel_block: int  # tokens a kernel call of the O(L^2) path
    prefill_chunk: int  # tokens a prefill call of `bench model`

    @classmethod
    def defaults(cls, model: Model) -> Still:
        from linearize.bench.model import FULL
        from linearize.config import StillConfig
        from linearize.ops.still import KERNEL_BLOCK
        from linearize.ops.still.chunked import CHUNK

        cfg = StillConfig()
        features = 2 * (cfg.feature_dim or model.head_dim // 2)  # `_add_feature_maps`: phi has 2 f features
        return cls(window=cfg.window, slots=cfg.slots, routing_chunk=cfg.chunk_size, features=features, block=CHUNK,
                   kernel_block=KERNEL_BLOCK, prefill_chunk=FULL["prefill_chunk"])


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes per token, summed over the layers: `bytes` every input and output once,
    `streamed` (default: the same) every tile as the programs read and write it."""

    flops: float
    bytes: float
    streamed: float | None = None

    def __post_init__(self):
        if self.streamed is None:
            object.__setattr__(self, "streamed", self.bytes)

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.streamed + other.streamed)

    def bound_s(self) -> float:
        """Seconds per token at the peaks: the slower of compute and memory."""
        return max(self.flops / PEAK_FLOPS, self.bytes / PEAK_BYTES)


def gemm_floor(m: Model, call_tokens: int) -> Cost:
    """q, k, v, o and the MLP, the weights read once per call of `call_tokens` tokens."""
    q_out, kv_out = m.heads * m.head_dim, m.kv_heads * m.head_dim
    gemms = [(m.hidden, q_out), (m.hidden, kv_out), (m.hidden, kv_out), (q_out, m.hidden),
             (m.hidden, m.intermediate), (m.hidden, m.intermediate), (m.intermediate, m.hidden)]
    weights = sum(i * o for i, o in gemms)
    activations = sum(i + o for i, o in gemms)
    return Cost(m.layers * 2 * weights, m.layers * BYTES * (activations + weights / call_tokens))


def causal_pairs(queries: int, prefix: int = 0) -> float:
    """(query, key) pairs of a causal pass over `prefix` carried rows then `queries` new ones, every row
    walked (the O(L^2) kernel's zero query rows of a continued call included)."""
    n = prefix + queries
    return n * (n + 1) / 2


def sdpa(m: Model, context: int) -> Cost:
    pairs = causal_pairs(context) / context  # per token
    d = m.head_dim
    io = (2 * m.heads + 2 * m.kv_heads) * d  # q, o; k, v
    rereads = m.heads * pairs * 2 * d / SDPA_QUERIES  # k, v per program of SDPA_QUERIES queries
    return Cost(m.layers * m.heads * pairs * 4 * d, m.layers * BYTES * io,
                m.layers * BYTES * (2 * m.heads * d + rereads))


def prefill_blocks(s: Still, context: int) -> list[tuple[int, int]]:
    """(new tokens, carried rows) of each kernel call of the O(L^2) path's prefill: calls of
    `prefill_chunk` tokens, each in blocks of `kernel_block`, only the very first fresh."""
    carried = s.slots + s.window - 1
    blocks, done = [], 0
    while done < context:
        call = min(s.prefill_chunk, context - done)
        for lo in range(0, call, s.kernel_block):
            n = min(s.kernel_block, call - lo)
            blocks.append((n, 0 if done + lo == 0 else carried))
        done += call
    return blocks


def still_quadratic(m: Model, s: Still, context: int) -> Cost:
    d, F = m.head_dim, s.features
    blocks = prefill_blocks(s, context)
    pairs = sum(causal_pairs(n, p) for n, p in blocks) / context
    rows = sum(n + p for n, p in blocks) / context  # query rows walked per token, the zero ones included
    row_bytes = BYTES * (3 * d + F)  # q, fq, the gate; y
    reads = pairs * (BYTES * (2 * d + F) + 5) / STILL_QUERIES  # k, v, fk; an int32 fold time, a validity byte
    heads = m.layers * m.heads
    return Cost(heads * pairs * (6 * d + 2 * F), heads * rows * row_bytes + _key_side(m, s),
                heads * (rows * row_bytes + reads))


def _key_side(m: Model, s: Still) -> float:
    """k, v per KV head, fk per query head, the fold times (int32) once per token."""
    return m.layers * (m.kv_heads * (BYTES * 2 * m.head_dim + 4) + m.heads * BYTES * s.features)


def still_chunked(m: Model, s: Still) -> Cost:
    d, F, C = m.head_dim, s.features, s.block
    keys = s.slots + s.window + C - 1
    flops = 4 * d * keys + 2 * C * (F + d) + 2 * F * d + 2 * F + 2 * F * d
    key_reads = BYTES * 2 * d * keys / C + BYTES * (F + d) + 4 * (s.slots + 1) / C  # + fold events, salient list
    state = 2 * STATE_BYTES * F * (d + 1) / C  # written, then read, once a block
    row_bytes = BYTES * (3 * d + F)
    heads = m.layers * m.heads
    return Cost(heads * flops, heads * row_bytes + _key_side(m, s), heads * (row_bytes + key_reads + state))


def still_extras(m: Model, s: Still, call_tokens: int) -> Cost:
    """The gate's projection, the feature maps and the routing's scores (both STILL forms)."""
    d, f = m.head_dim, s.features // 2
    gate = m.hidden * m.heads * d
    features = 2 * m.heads * (2 * d * f + 4 * d)  # q and each query head's k: a reflection, then d x f
    routing = m.heads * 2 * (2 * s.routing_chunk) * d
    flops = 2 * gate + features + routing
    return Cost(m.layers * flops, m.layers * BYTES * (m.hidden + m.heads * d + gate / call_tokens))


def rows(m: Model, s: Still, contexts: list[int]) -> list[dict]:
    """One row per (context, method): the attention's cost per token and the total with the floor."""
    out = []
    for context in contexts:
        linear_floor = gemm_floor(m, min(context, s.prefill_chunk))
        extras = still_extras(m, s, min(context, s.prefill_chunk))
        none = Cost(0.0, 0.0)
        for method, floor, attention in [
                ("GEMM floor", linear_floor, none),
                ("SDPA", gemm_floor(m, context), sdpa(m, context)),
                ("STILL, O(L^2) kernel", linear_floor + extras, still_quadratic(m, s, context)),
                ("STILL, chunked", linear_floor + extras, still_chunked(m, s))]:
            total = floor + attention
            out.append({"context": context, "method": method, "attention": attention, "total": total,
                        "floor": linear_floor})
    return out


def table(m: Model, s: Still, contexts: list[int]) -> str:
    lines = [("| context | method | attention GFLOP/token | attention KB/token | attention KB/token streamed "
             "| total GFLOP/token | total KB/token | total FLOP/byte streamed | bound / floor's | prefill bound (s) |"),
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows(m, s, contexts):
        a, t = row["attention"], row["total"]
        lines.append(f"| {_size(row['context'])} | {row['method']} | {a.flops / 1e9:.3f} | {a.bytes / 1e3:.1f} "
                     f"| {a.streamed / 1e3:.1f} | {t.flops / 1e9:.2f} | {t.bytes / 1e3:.1f} "
                     f"| {t.flops / t.streamed:.0f} | {t.bound_s() / row['floor'].bound_s():.2f} "
                     f"| {t.bound_s() * row['context']:.3g} |")
    return "\n".join(lines)


def _size(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _parse_size(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b", help="a `linearize.bench.shapes` shape")
    parser.add_argument("--contexts", default="16k,128k", help="comma-separated, e.g. 16k,128k")
    args = parser.parse_args(argv)
    m = Model.from_shape(args.shape)
    s = Still.defaults(m)
    text = (f"{args.shape}: {m.layers} layers, {m.heads} heads ({m.kv_heads} KV), d = {m.head_dim}; STILL window "
            f"{s.window}, {s.slots} slots, F = {s.features}, chunked C = {s.block}; prefill calls of "
            f"{_size(s.prefill_chunk)} tokens, kernel blocks of {_size(s.kernel_block)}\n\n"
            + table(m, s, [_parse_size(c) for c in args.contexts.split(",")]))
    print(text)
    return text


if __name__ == "__main__":
    main()
