"""`kernels_pallas.ops.pick`, the one place a projection's kernel is chosen: its table for every (weight format,
kernels) over classes of row counts and output widths, written out so that a change to it fails here, and the
weight formats it reads (`weight_format`)."""

import jax.numpy as jnp
import pytest

from kernels_pallas import ops

ROWS = (0, 1, 4, 17, 65, 4096)  # empty, decode step, batched decode (4 slots), verify (17 / 65 nodes), prefill
COLS = (1024, 2048, 5120)  # output widths: narrow, the GEMV's threshold, every fused 27B projection
# per row class (space-separated), the kernel at each width: P the Pallas GEMV with the gate / residual inside it and
# its split-K partials into the decode consumer; F the same without partials; U the plain GEMV, its parts as XLA
# ops; X XLA's einsum; W the Pallas W8A8 kernel; R its jnp
# reference
TABLE = {
    ("bf16", "pallas"): "XXX XPP XXX XXX XXX XXX",
    ("bf16", "pallas:no_partials"): "XXX XFF XXX XXX XXX XXX",
    ("bf16", "pallas:unfused"): "XXX XUU XXX XXX XXX XXX",
    ("bf16", "pallas:unroll4"): "XXX XPP XXX XXX XXX XXX",  # (the unroll variants pick as "pallas")
    ("bf16", "pallas:unroll16"): "XXX XPP XXX XXX XXX XXX",
    ("bf16", "pallas:split_mlp"): "XXX XPP XXX XXX XXX XXX",  # (picks as "pallas"; the MLP's SwiGLU apart)
    ("bf16", "xla"): "XXX XXX XXX XXX XXX XXX",
    ("fp32", "pallas"): "XXX XXX XXX XXX XXX XXX",
    ("fp32", "pallas:unfused"): "XXX XXX XXX XXX XXX XXX",
    ("fp32", "xla"): "XXX XXX XXX XXX XXX XXX",
    ("w8a8", "pallas"): "RRR WWW WWW WWW WWW WWW",
    ("w8a8", "pallas:unfused"): "RRR WWW WWW WWW WWW WWW",
    ("w8a8", "xla"): "RRR RRR RRR RRR RRR RRR",
    ("w8a8/24", "pallas"): "RRR RRR RRR RRR RRR RRR",  # input block 24: no power-of-two K chunk >= 16 divides it
}
LETTER = {("gemv", True, True): "P", ("gemv", True, False): "F", ("gemv", False, False): "U",
          ("xla", False, False): "X", ("w8a8", False, False): "W", ("w8a8_ref", False, False): "R"}


def _row(fmt: str, kernels: str) -> str:
    fmt, _, block = fmt.partition("/")
    block_in = int(block or 128)
    return " ".join("".join(LETTER[tuple(ops.pick(fmt, r, c, kernels, block_in=block_in))] for c in COLS)
                    for r in ROWS)


def test_table():
    got = {key: _row(*key) for key in TABLE}
    assert got == TABLE
    assert set(ops.VARIANTS) == {"pallas", "pallas:no_partials", "pallas:unfused", "pallas:unroll4", "pallas:unroll16",
                                 "pallas:split_mlp"}  # a new variant: add its rows
    assert [ops.scan_unroll(k) for k in ("xla", "pallas", "pallas:unfused", "pallas:unroll4")] == [1, 1, 1, 4]
    tree = [ops.scan_unroll(k, tree=True) for k in ("xla", "pallas", "pallas:unfused", "pallas:unroll4")]
    assert tree == [1, 2, 2, 4]
    assert [ops.add_norm_fuses(k) for k in ("xla", "pallas", "pallas:unfused")] == [False, True, True]


def test_gemv_thresholds_are_the_only_override():
    """Tests reach the GEMV at tiny shapes by widening its domain (gemv_rows / gemv_cols); the rest of the table
    stays."""
    assert ops.pick("bf16", 8, 64, "pallas", gemv_rows=8, gemv_cols=1) == ops.Choice("gemv", True, True)
    assert ops.pick("bf16", 9, 64, "pallas", gemv_rows=8, gemv_cols=1).kernel == "xla"
    assert ops.pick("fp32", 1, 64, "pallas", gemv_rows=8, gemv_cols=1).kernel == "xla"
    assert ops.pick("bf16", 1, 64, "xla", gemv_rows=8, gemv_cols=1).kernel == "xla"


def test_weight_format():
    bf, f32, fp8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
    assert [ops.weight_format(x, w) for x, w in ((bf, bf), (f32, f32), (bf, f32), (f32, bf), (bf, fp8), (f32, fp8))] \
        == ["bf16", "fp32", "fp32", "fp32", "w8a8", "w8a8"]
    with pytest.raises(ValueError, match="FP8 weights take bf16 or float32 activations"):
        ops.weight_format(jnp.float16, fp8)


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown kernels 'triton'"):
        ops.pick("bf16", 1, 4096, "triton")
    with pytest.raises(ValueError, match="unknown weight format 'int4'"):
        ops.pick("int4", 1, 4096, "pallas")
    with pytest.raises(ValueError, match="must contract x's trailing axes"):
        ops.dense("btd,cd->btc", jnp.ones((1, 1, 8)), jnp.ones((4, 8)))


def test_w8a8_on_hopper_takes_the_fp8_wgmma_kernel():
    """On a Hopper GPU (here: lowering for an abstract H200) kernels="pallas" runs W8A8 on the Mosaic GPU kernel
    wherever it takes the problem (every 27B projection, at any row count); the Triton kernel where it does not
    (output blocks not a multiple of 64, input blocks other than 128); the reference with kernels="xla"."""
    from kernels_pallas._common import abstract_h200
    with abstract_h200():
        for rows in (1, 16, 65, 129, 2048):
            assert ops.pick("w8a8", rows, 34816, "pallas", block_in=128, block_out=128, depth=5120).kernel \
                == "w8a8_mgpu"
        assert ops.pick("w8a8", 1, 5120, "pallas", block_in=128, block_out=24, depth=5120).kernel == "w8a8"
        assert ops.pick("w8a8", 1, 5120, "pallas", block_in=64, block_out=128, depth=5120).kernel == "w8a8"
        assert ops.pick("w8a8", 1, 5120, "pallas", block_in=128, block_out=128, depth=5000).kernel == "w8a8"
        assert ops.pick("w8a8", 1, 5120, "xla", block_in=128, block_out=128, depth=5120).kernel == "w8a8_ref"
    assert ops.pick("w8a8", 1, 34816, "pallas", block_in=128, block_out=128, depth=5120).kernel == "w8a8"  # CPU
