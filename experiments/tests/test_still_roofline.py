"""The roofline arithmetic of STILL's prefill (experiments/still/roofline.py) on a small shape."""

import torch

from experiments.still import roofline
from linearize.ops.still import chunked


def test_the_table_has_every_method_at_every_context():
    text = roofline.main(["--shape", "smollm2", "--contexts", "1k,4k"])
    rows = [line for line in text.splitlines() if line.startswith(("| 1K", "| 4K"))]
    assert len(rows) == 8
    assert {row.split("|")[2].strip() for row in rows} == {"GEMM floor", "SDPA", "STILL, O(L^2) kernel",
                                                           "STILL, chunked"}


def test_pairs_and_blocks_count_what_the_kernels_walk():
    n, p = 37, 5
    mask = torch.ones(p + n, p + n).tril()
    assert roofline.causal_pairs(n, p) == mask.sum()
    s = roofline.Still(window=8, slots=24, routing_chunk=4, features=16, block=4, kernel_block=100, prefill_chunk=250)
    blocks = roofline.prefill_blocks(s, 620)
    assert [n for n, _ in blocks] == [100, 100, 50, 100, 100, 50, 100, 20]  # calls of 250 in blocks of 100
    assert [p for _, p in blocks] == [0] + [s.slots + s.window - 1] * 7  # only the first fresh


def test_the_chunked_form_costs_the_same_per_token_at_any_context_and_sdpa_grows():
    m = roofline.Model.from_shape("smollm2")
    s = roofline.Still.defaults(m)
    assert s.block == chunked.CHUNK
    short, long = (roofline.rows(m, s, [c]) for c in (2048, 8192))
    cost = {(row["context"], row["method"]): row["attention"] for row in short + long}
    assert cost[2048, "STILL, chunked"] == cost[8192, "STILL, chunked"]
    ratio = cost[8192, "SDPA"].flops / cost[2048, "SDPA"].flops
    assert 3.9 < ratio < 4.1  # pairs per token grow with the context
    assert cost[8192, "STILL, chunked"].flops < cost[8192, "STILL, O(L^2) kernel"].flops
    # The chunked form's FLOPs: 4 d a softmax key over the K + W + C - 1 keys a block reads, the linear part beside.
    d, F, C = m.head_dim, s.features, s.block
    softmax = 4 * d * (s.slots + s.window + C - 1) * m.heads * m.layers
    assert softmax < cost[2048, "STILL, chunked"].flops < softmax + m.heads * m.layers * (2 * C * (F + d) + 5 * F * d)
