"""Every kernel lowers to Triton for an abstract H200, on the CPU.

Interpret mode accepts things Triton rejects (non-power-of-two blocks, sort,
gather...): this catches a kernel that only works interpreted.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
import h200
from lowbit_jax import sage as sage_mod

TRITON_CALL = "__gpu$xla.gpu.triton"
FWD_KERNELS = ("sage_channel_stats", "sage_quantize_q", "sage_quantize_kv", "sage_attention_fwd")
BWD_KERNELS = ("sage_bwd_preprocess", "sage_bwd_dkdv", "sage_bwd_dq")

CASES = [
    # (Sq, Sk, Hq, Hkv, D, causal, granularity, smooth_q, config)
    (4096, 4096, 8, 8, 128, False, "per_block", False, lb.sage_fwd_config(128, False, "NVIDIA H200")),
    (1000, 1000, 8, 2, 128, True, "per_block", False, lb.SageFwdConfig(128, 128, 8, 3, dq_block_k=128, dq_warps=8)),
    (300, 700, 8, 1, 64, True, "per_token", True, lb.sage_fwd_config(64, True, "NVIDIA H200")),
    (77, 50, 4, 2, 64, False, "per_block", True, lb.SageFwdConfig(64, 64, 4, 2, bwd_block_q=32, ds_scale="row")),
    (256, 256, 2, 2, 32, False, "per_token", False, lb.SageFwdConfig(64, 64, 4, 2)),
]


def lower_for_h200(fn, *specs) -> str:
    """The module text of ``jax.jit(fn)`` lowered for an abstract H200 (``benchmarks.h200.lower_for_h200``)."""
    return h200.lower_for_h200(fn, *specs).as_text()


def triton_named(text: str, name: str) -> bool:
    """A Triton kernel call named ``name`` (its ``pallas_call`` name) is in the lowered text."""
    return f'name = "{name}"' in text


def mosaic_named(text: str, name: str) -> bool:
    """A Mosaic GPU kernel launched as ``name`` (``_mosaic.launch``) is in the lowered text."""
    return f"{name}_mosaic_gpu" in text


def specs_and_options(sq, sk, hq, hkv, d, causal, granularity, smooth_q, config):
    q = jnp.zeros((2, sq, hq, d), jnp.bfloat16)
    kv = jnp.zeros((2, sk, hkv, d), jnp.bfloat16)
    opts = sage_mod.resolve_options(q, kv, kv, causal=causal, scale=None, smooth_k=True, smooth_q=smooth_q,
                                    qk_granularity=granularity, implementation="pallas", interpret=True,
                                    config=config)
    opts = dataclasses.replace(opts, interpret=False)  # compile for the GPU, not interpret
    to_spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    return (to_spec(q), to_spec(kv), to_spec(kv)), opts


@pytest.mark.parametrize("case", CASES)
def test_sage_forward_lowers_to_triton(case):
    specs, opts = specs_and_options(*case)
    text = lower_for_h200(lambda q, k, v: sage_mod._forward(q, k, v, opts=opts, transposed=False), *specs)
    assert text.count(TRITON_CALL) == len(FWD_KERNELS)
    for name in FWD_KERNELS:
        assert name in text


@pytest.mark.parametrize("case", CASES)
def test_sage_backward_lowers_to_triton(case):
    specs, opts = specs_and_options(*case)

    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(sage_mod._sage_attention(q, k, v, None, opts).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = lower_for_h200(grads, *specs)
    assert text.count(TRITON_CALL) == len(FWD_KERNELS) + len(BWD_KERNELS)
    for name in FWD_KERNELS + BWD_KERNELS:
        assert name in text


def test_lowering_detects_unsupported_primitive():
    """The check is real: a kernel using `round` (unsupported by the Triton lowering) fails."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.round(x_ref[...])

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    with pytest.raises(Exception):
        lower_for_h200(f, jax.ShapeDtypeStruct((16, 16), jnp.float32))


def _nvfp4_tile_kernel(x_ref, o_ref, c_ref):
    from pallas_kernels.numerics import nvfp4

    values, sf = nvfp4.quantize_groups(x_ref[...])  # (rows, 16) tile = one group per row
    codes = nvfp4.e2m1_code(values)
    c_ref[...] = codes
    o_ref[...] = nvfp4.e2m1_decode(codes) * sf


def _nvfp4_tile_call(x, interpret):
    from jax.experimental import pallas as pl

    return pl.pallas_call(_nvfp4_tile_kernel, interpret=interpret, name="nvfp4_tile",
                          out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                     jax.ShapeDtypeStruct(x.shape, jnp.int32)])(x)


def test_nvfp4_element_functions_lower_and_match():
    """The NVFP4 helpers are kernel-safe: they lower to Triton and give the host result in a kernel."""
    import numpy as np

    from pallas_kernels.numerics import nvfp4

    text = lower_for_h200(lambda x: _nvfp4_tile_call(x, False), jax.ShapeDtypeStruct((32, 16), jnp.float32))
    assert TRITON_CALL in text
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 16)) * 3, jnp.float32)
    out, _ = _nvfp4_tile_call(x, True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(nvfp4.dequantize(nvfp4.quantize(x))))


def _packed_decode_kernel(p_ref, lo_ref, hi_ref):
    from pallas_kernels.numerics import nvfp4

    lo, hi = nvfp4.e2m1_unpack(p_ref[...])
    lo_ref[...] = nvfp4.e2m1_decode_f16(lo)
    hi_ref[...] = nvfp4.e2m1_decode_f16(hi)


def test_packed_e2m1_decode_lowers_and_matches():
    """The shared in-kernel decode (uint8 pairs → fp16 by bit placement) lowers to Triton, no gather."""
    import numpy as np
    from jax.experimental import pallas as pl

    from pallas_kernels.numerics import nvfp4

    def call(p, interpret):
        shape = jax.ShapeDtypeStruct(p.shape, jnp.float16)
        return pl.pallas_call(_packed_decode_kernel, out_shape=[shape, shape], interpret=interpret,
                              name="e2m1_decode")(p)

    # packed bytes travel as int8 (Triton refuses unsigned ints in some ops); the helper masks the nibbles
    text = lower_for_h200(lambda p: call(p, False), jax.ShapeDtypeStruct((16, 32), jnp.int8))
    assert TRITON_CALL in text and "gather" not in text.lower()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, 64)), jnp.float32)
    t = nvfp4.quantize(x)
    lo, hi = call(jax.lax.bitcast_convert_type(t.codes, jnp.int8), True)
    sf = np.repeat(np.asarray(t.scales, np.float32), 8, axis=-1) * nvfp4.E2M1_F16_BIAS
    deq = np.asarray(nvfp4.dequantize(t))
    np.testing.assert_array_equal(np.asarray(lo, np.float32) * sf, deq[:, 0::2])
    np.testing.assert_array_equal(np.asarray(hi, np.float32) * sf, deq[:, 1::2])


def _f16_pair(word):
    """uint32 words → their two 16-bit lanes as float16 (..., 2), lane 0 first."""
    return np.stack([word & np.uint32(0xFFFF), word >> np.uint32(16)], -1).astype(np.uint16).view(np.float16)


def _run_ptx(asm: str, regs: dict) -> dict:
    """A numpy evaluator of the b32 integer PTX the decode kernels inline (prmt in its default mode, and, or, shl,
    shr, mul.rn.f16x2) on uint32 arrays: ``regs`` maps "$i" and named registers to values; returns them after."""
    regs = dict(regs)

    def val(tok):
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [t.strip() for t in args.split(",")]
        x = [val(t) for t in src]
        if op == "prmt.b32":  # bytes of {x[1], x[0]} picked by the selector's four nibbles
            pool = [(x[0] >> np.uint32(8 * i)) & np.uint32(255) for i in range(4)]
            pool += [(x[1] >> np.uint32(8 * i)) & np.uint32(255) for i in range(4)]
            sel = int(src[2], 0)
            out = np.uint32(0)
            for i in range(4):
                nib = (sel >> (4 * i)) & 15
                assert nib < 8, "sign-replicating selectors are not modelled"
                out = out | (pool[nib] << np.uint32(8 * i))
            regs[dst] = out
        elif op == "and.b32":
            regs[dst] = x[0] & x[1]
        elif op == "or.b32":
            regs[dst] = x[0] | x[1]
        elif op == "shl.b32":
            regs[dst] = (x[0] << x[1]) & np.uint32(0xFFFFFFFF)
        elif op == "shr.b32":
            regs[dst] = x[0] >> x[1]
        elif op == "mul.rn.f16x2":
            prod = (_f16_pair(x[0]) * _f16_pair(x[1])).view(np.uint16).astype(np.uint32)
            regs[dst] = prod[..., 0] | (prod[..., 1] << np.uint32(16))
        else:
            raise AssertionError(f"unmodelled PTX: {line}")
    return regs


def test_e2m1_inline_ptx_gives_the_shared_decode():
    """The decode kernels' inline PTX (``_triton.e2m1_unpack_f16``, the Mosaic 4-bit kernel's ``_decode_asm``), run
    by a numpy PTX evaluator on every cache byte in every position, gives ``nvfp4.e2m1_decode_f16``'s bits for
    both elements of each byte (``nvfp4.unpack_pair``)."""
    import numpy as np

    from pallas_kernels import _triton, thrift_decode_mosaic
    from pallas_kernels.numerics import nvfp4

    byte = np.arange(256, dtype=np.uint32)
    others = [(byte * 37 + 11) % 256, (byte * 101 + 7) % 256, (byte * 59 + 201) % 256]
    bits16 = lambda codes: np.asarray(jax.lax.bitcast_convert_type(  # noqa: E731
        nvfp4.e2m1_decode_f16(jnp.asarray(codes)), jnp.uint16)).astype(np.uint32)
    for key, element in (("lo", 0), ("hi", 1)):
        want = [bits16(np.asarray(nvfp4.unpack_pair(jnp.asarray(x))[element])) for x in [byte, *others]]
        word = byte | (others[0] << 8) | (others[1] << 16) | (others[2] << 24)  # Triton: four bytes a register
        out = _run_ptx(_triton._e2m1_unpack_asm(key), {"$2": word})
        for reg, (b0, b1) in (("$0", (0, 1)), ("$1", (2, 3))):
            np.testing.assert_array_equal(out[reg] & 0xFFFF, want[b0])
            np.testing.assert_array_equal(out[reg] >> 16, want[b1])
        one = np.uint32(0x3C003C00)  # the fp16 pair (1, 1): the Mosaic block's scale multiply keeps the bits
        out = _run_ptx(thrift_decode_mosaic._decode_asm(key), {"$1": byte | (others[0] << 8), "$2": one})
        np.testing.assert_array_equal(out["$0"] & 0xFFFF, want[0])
        np.testing.assert_array_equal(out["$0"] >> 16, want[1])


def compiled_options(resolve, q, kv, **options):
    """A method's resolved options (``resolve(q, k, v, ...)``) for zero arrays shaped as the specs q and kv, with
    the Pallas kernels compiled for the GPU rather than interpreted (resolving "pallas" on a CPU needs
    ``interpret=True``, lowering needs it off)."""
    zeros = lambda spec: jnp.zeros(spec.shape, spec.dtype)  # noqa: E731
    opts = resolve(zeros(q), zeros(kv), zeros(kv), implementation="pallas", interpret=True, **options)
    return dataclasses.replace(opts, interpret=False)


QAT_KERNELS = ("fp4_fake_quant", "qat_attention_fwd", "qat_bwd_dkdv", "qat_bwd_dq")
QAT_CASES = [  # (Sq, Sk, Hq, Hkv, D, causal, naive, config)
    (4096, 4096, 8, 8, 128, False, False, lb.QatConfig()),
    (1000, 700, 8, 2, 64, True, False, lb.QatConfig(block_q=128, block_k=64, num_warps=8)),
    (77, 50, 4, 1, 128, True, True, lb.QatConfig(bwd_block_q=32, bwd_block_k=32)),
]


@pytest.mark.parametrize("case", QAT_CASES)
def test_qat_forward_and_backward_lower_to_triton(case):
    from lowbit_jax import qat as qat_mod

    sq, sk, hq, hkv, d, causal, naive, config = case
    q = jax.ShapeDtypeStruct((2, sq, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, sk, hkv, d), jnp.bfloat16)
    opts = compiled_options(qat_mod.resolve_qat_options, q, kv, causal=causal, naive_backward=naive, config=config)

    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(qat_mod._qat_attention(q, k, v, None, opts).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = lower_for_h200(grads, q, kv, kv)
    # fake-quant (one lowered function per distinct shape, called for q, k, v), forward, two backward kernels
    assert text.count(TRITON_CALL) >= len(QAT_KERNELS)
    for name in QAT_KERNELS:
        assert name in text


THRIFT_KERNELS = ("thrift_select", "fp4_fake_quant", "thrift_prefill")
THRIFT_CASES = [  # (Sq, Sk, Hq, Hkv, D, causal, budget, config)
    (16384, 16384, 8, 2, 128, True, 0.05, lb.ThriftConfig()),  # 256 key blocks: scored once, one piece
    (1000, 700, 4, 4, 64, False, 0.25, lb.ThriftConfig(block=32, quant_block=32, select_chunk=16,
                                                       select_whole=16)),  # 22 key blocks in two scoring chunks
    (77, 300, 4, 1, 128, True, 1.0, lb.ThriftConfig(block=128, quant_block=128)),
    (20000, 20000, 4, 1, 64, True, 0.05, lb.ThriftConfig(prefill_chunk=64)),  # 4 chunks in a loop + 57 blocks
]


@pytest.mark.parametrize("case", THRIFT_CASES)
def test_thrift_prefill_lowers_to_triton(case):
    from lowbit_jax import thrift as thrift_mod

    sq, sk, hq, hkv, d, causal, budget, config = case
    q = jax.ShapeDtypeStruct((1, sq, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, sk, hkv, d), jnp.bfloat16)
    opts = compiled_options(thrift_mod.resolve_thrift_options, q, kv, causal=causal, budget=budget, config=config)
    text = lower_for_h200(lambda q, k, v: thrift_mod.thrift_forward(q, k, v, opts=opts), q, kv, kv)
    assert text.count(TRITON_CALL) >= len(THRIFT_KERNELS)  # the operand pass once per distinct shape
    for name in THRIFT_KERNELS:
        assert triton_named(text, name), name


@pytest.mark.parametrize("t, hq, d, block", [(1, 32, 128, 64), (5, 8, 64, 32), (40, 8, 128, 128)])
def test_thrift_decode_lowers_to_triton(t, hq, d, block):
    """The split-KV decode kernel (1 or several row tiles: 40 tokens × 4 heads of a group is 160 rows)."""
    from lowbit_jax import thrift as thrift_mod

    cache = jax.eval_shape(lambda: lb.ThriftKVCache.create(2, 8192, 8, d, block=block))
    q = jax.ShapeDtypeStruct((2, t, hq, d), jnp.bfloat16)
    cfg = lb.ThriftConfig(block=block)
    text = lower_for_h200(lambda q, c: thrift_mod._decode(q, c, budget=0.05, scale=d**-0.5, implementation="pallas",
                                                          interpret=False, config=cfg), q, cache)
    assert triton_named(text, "thrift_decode") and triton_named(text, "thrift_decode_order")
    assert triton_named(text, "thrift_combine")
    assert "prmt.b32" in text  # the 4-bit blocks decode through the inline PTX (interpret mode: jax.numpy)


@pytest.mark.parametrize("t, hq, d, wgs", [(1, 32, 128, 1), (3, 8, 64, 1), (16, 8, 128, 1), (1, 32, 128, 2),
                                           (3, 8, 64, 4)])  # Mosaic: 8, 8, 16 rows a CTA
def test_thrift_decode_mosaic_lowers(t, hq, d, wgs):
    """``decode_backend="mosaic"``: the 4-bit runs lower to the Mosaic GPU kernel (its inline PTX decode and lane
    shuffles; with ``decode_compute_wgs`` > 1 the producer kernel, its warpgroups' register counts set), the 16-bit
    runs to the Triton kernel."""
    from lowbit_jax import thrift as thrift_mod

    cache = jax.eval_shape(lambda: lb.ThriftKVCache.create(2, 131072, 8, d))
    q = jax.ShapeDtypeStruct((2, t, hq, d), jnp.bfloat16)
    cfg = lb.ThriftConfig(decode_backend="mosaic", decode_compute_wgs=wgs)
    text = lower_for_h200(lambda q, c: thrift_mod._decode(q, c, budget=0.05, scale=d**-0.5, implementation="pallas",
                                                          interpret=False, config=cfg), q, cache)
    assert text.count("mosaic_gpu_v2(") == 1 and "thrift_decode_low" in text
    assert triton_named(text, "thrift_decode") and triton_named(text, "thrift_combine")
    assert ("setmaxnreg" in text) == (wgs > 1)


@pytest.mark.parametrize("d, block, dtype", [(128, 64, jnp.bfloat16), (64, 32, jnp.float32), (32, 128, jnp.float16)])
def test_thrift_token_append_lowers_to_triton(d, block, dtype):
    """The one-token cache append kernel, with every cache array aliased to its output (written in place)."""
    from lowbit_jax import thrift_cache

    cache = jax.eval_shape(lambda: lb.ThriftKVCache.create(2, 8192, 8, d, dtype=dtype, block=block))
    row = jax.ShapeDtypeStruct((2, 1, 8, d), dtype)
    text = lower_for_h200(lambda c, k, v: thrift_cache._append_token(c, k, v, interpret=False), cache, row, row)
    assert triton_named(text, "thrift_append_token")
    assert text.count("output_operand_alias<") == 7


@pytest.mark.parametrize("causal, ds_scale, sq, d, granularity, fused", [
    (False, "tile", 1024, 128, "per_token", False), (True, "tile", 384, 128, "per_token", False),
    (True, "row", 380, 128, "per_token", False), (True, "tile", 300, 64, "per_block", True),
    (False, "tile", 512, 64, "per_block", False), (False, "tile", 384, 128, "per_block", True),
    (True, "tile", 384, 128, "per_block", True)])
def test_sage_backward_lowers_to_mosaic_gpu(causal, ds_scale, sq, d, granularity, fused):
    """With both SageBwd kernels on the Mosaic backend, they lower for an H200 as Mosaic GPU calls
    (dS scales per tile, or per row: ``ds_scale``; Sq = 380 and 300 are not multiples of the TMA tiling's
    8 rows, which only the lowering — not the interpreter — rejects). ``fused``: dq_kernel="auto" (fused at
    every head dim) with per-block scales, one Mosaic kernel (dQ reduce-added by TMA); else
    "separate" (two). The fused dQ's accumulator is zeroed by the preprocess."""
    cfg = dataclasses.replace(lb.sage_fwd_config(d, causal, "NVIDIA H200"), dkdv_backend="mosaic",
                              dq_backend="mosaic", fwd_backend="triton", ds_scale=ds_scale,
                              dq_kernel="auto" if fused else "separate")
    specs, opts = specs_and_options(sq, 512, 8, 2, d, causal, granularity, False, cfg)

    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(sage_mod._sage_attention(q, k, v, None, opts).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = lower_for_h200(grads, *specs)
    # the forward and the bwd preprocess; fused, the pair-ordered K̂ and Ṽ (``sage_bwd_kv_operands``) too
    assert text.count(TRITON_CALL) == len(FWD_KERNELS) + 1 + fused
    assert triton_named(text, "sage_bwd_kv_operands") == fused
    assert not triton_named(text, "sage_bwd_dkdv") and not triton_named(text, "sage_bwd_dq")
    assert text.count("mosaic_gpu_v2(") == (1 if fused else 2)
    assert mosaic_named(text, "sage_bwd_dkdv_dq" if fused else "sage_bwd_dkdv")
    assert mosaic_named(text, "sage_bwd_dq") != fused
    # the fused dQ's float32 accumulator is zeroed after dO exists, so XLA cannot hoist and merge the fills of a
    # model's layers into one early fusion (all layers' workspaces live at once): by the preprocess, which reads dO
    # (a fourth output)
    outputs = re.search(r"func\.func private @sage_bwd_preprocess\([^)]*\) -> \(([^)]*)\)", text)
    assert outputs and outputs.group(1).count("tensor<") == 3 + fused


@pytest.mark.parametrize("d, causal, sq, granularity, pv_format", [
    (128, False, 384, "per_block", "e4m3"), (128, True, 380, "per_token", "e4m3"), (64, True, 380, "per_block", "e4m3"),
    (64, False, 640, "per_token", "e4m3"), (128, True, 384, "per_block", "int8"), (64, False, 380, "per_token", "int8")])
def test_sage_forward_lowers_to_mosaic_gpu(d, causal, sq, granularity, pv_format):
    """fwd_backend="mosaic" (the Hopper default at head dims 64 and 128): the quantize kernels stay Triton,
    the attention is a Mosaic GPU call; per-block scales take the one-scalar-product path. Sq = 380 is
    not a multiple of the 8 rows a tiled TMA store needs (only lowering catches that). Both P·V formats: e4m3
    (the Hopper default; V̂ᵀ then leaves the K/V quantize kernel as float8_e4m3fn) and INT8."""
    cfg = dataclasses.replace(lb.sage_fwd_config(d, causal, "NVIDIA H200"), fwd_backend="mosaic",
                              pv_format=pv_format)
    specs, opts = specs_and_options(sq, 512, 8, 2, d, causal, granularity, False, cfg)
    text = lower_for_h200(lambda q, k, v: sage_mod._forward(q, k, v, opts=opts, transposed=False), *specs)
    assert text.count(TRITON_CALL) == 3  # sage_channel_stats, sage_quantize_q, sage_quantize_kv; no Triton attention
    assert all(name in text for name in ("sage_channel_stats", "sage_quantize_q", "sage_quantize_kv"))
    assert mosaic_named(text, "sage_attention_fwd")
    assert ("f8E4M3FN" in text) == (pv_format == "e4m3")


@pytest.mark.parametrize("method", ["sage", "qat"])
def test_mosaic_forward_row_outputs_span_whole_ctas(method):
    """The LSE (and QAT's m) of a Mosaic forward whose last CTA passes Sq_pad get rows for whole CTAs: Mosaic GPU
    folds ``lse_ref.at[b, h, rows]``'s indexed dims into the TMA's row offset, so a store past Sq_pad is not
    clipped but overwrites the next head's first rows (``_mosaic.query_ctas``). Sq 640 over three warpgroups' 192-row
    CTAs (sage causal; Attn-QAT's O-only forward, non-causal): 4 CTAs, 768 rows; O keeps 640 (its stores are
    clipped). Only the GPU run showed the bug (the interpreter
    pads every output), so this pins the launch's result types."""
    from lowbit_jax import qat as qat_mod

    q = jax.ShapeDtypeStruct((2, 640, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 640, 2, 64), jnp.bfloat16)
    if method == "sage":
        cfg = dataclasses.replace(lb.sage_fwd_config(64, True, "NVIDIA H200"), fwd_backend="mosaic")
        opts = compiled_options(sage_mod.resolve_options, q, kv, causal=True, config=cfg)
        fn = lambda q, k, v: sage_mod._forward(q, k, v, opts=opts, transposed=False)[:2]  # noqa: E731
        rows = 1
    else:  # three warpgroups in the O-only, non-causal forward (qat_fwd_mosaic.compute_wgs)
        opts = compiled_options(qat_mod.resolve_qat_options, q, kv, causal=False,
                                config=lb.QatConfig(fwd_backend="mosaic"))
        fn = lambda q, k, v: qat_mod.qat_forward(q, k, v, opts=opts, with_aux=False)[:4]  # noqa: E731
        rows = 2
    text = lower_for_h200(fn, q, kv, kv)
    jax.clear_caches()
    launches = re.findall(r"mosaic_gpu_v2\(.*-> \((.*)\)$", text, flags=re.M)
    assert len(launches) == 1, launches
    results = re.findall(r"tensor<([\dx]+)x(bf16|f32)>", launches[0])
    assert [shape for shape, dtype in results if dtype == "f32"] == ["2x8x768"] * rows, results
    assert all(shape == "2x640x8x64" for shape, dtype in results if dtype == "bf16"), results


@pytest.mark.parametrize("d, causal, naive", [(128, False, False), (64, True, False), (128, True, True)])
@pytest.mark.parametrize("backends", [("mosaic", "triton"), ("mosaic", "mosaic"), ("triton", "mosaic"),
                                      ("mosaic", "mosaic", "pingpong"), ("mosaic", "mosaic", "fused"),
                                      ("mosaic", "mosaic", "separate")])
def test_qat_lowers_to_mosaic_gpu(d, causal, naive, backends):
    """QatConfig(fwd_backend=…, bwd_backend=…): the kernels on "mosaic" lower for an H200 as Mosaic GPU calls
    (forward: register P̃/P operands, O and O' issued together; backward: FQ(P)·(1/l) and dS through SMEM as
    transposed operands, dS·K̃ from registers); the fake-quant kernel and the others stay Triton. A third
    entry: "pingpong" turns on the schedule barrier (QatConfig.pingpong); "fused"/"separate" is
    QatConfig.dq_kernel (default "auto": fused everywhere — split by columns between the warpgroups at
    D128 — so the dQ kernel is then absent)."""
    from lowbit_jax import qat as qat_mod
    from pallas_kernels import qat_bwd_mosaic

    fwd, bwd, *extra = backends
    dq_kernel = extra[0] if extra and extra[0] in ("fused", "separate") else "auto"
    q = jax.ShapeDtypeStruct((2, 300 if d == 64 else 384, 8, d), jnp.bfloat16)  # 300: not a multiple of 8
    kv = jax.ShapeDtypeStruct((2, 300 if d == 64 else 512, 2, d), jnp.bfloat16)
    opts = qat_mod.resolve_qat_options(jnp.zeros(q.shape, q.dtype), jnp.zeros(kv.shape, kv.dtype),
                                       jnp.zeros(kv.shape, kv.dtype), causal=causal, naive_backward=naive,
                                       implementation="pallas", interpret=True,
                                       config=lb.QatConfig(fwd_backend=fwd, bwd_backend=bwd,
                                                           pingpong=extra == ["pingpong"], dq_kernel=dq_kernel))
    opts = dataclasses.replace(opts, interpret=False)

    def grads(q, k, v, w):  # a cotangent w, not a constant (XLA would fold dO's transpose into a broadcast)
        loss = lambda q, k, v: jnp.sum(qat_mod._qat_attention(q, k, v, None, opts).astype(jnp.float32) * w)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = lower_for_h200(grads, q, kv, kv, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    assert "mosaic_gpu" in text and "fp4_fake_quant" in text
    # the Mosaic backward reads dO (B, Sq, Hq, D) as it is: no head-major copy
    do_transposed = re.search(r"stablehlo.transpose .*dims = \[0, 2, 1, 3\].*tensor<2x8x\d+x\d+xbf16>", text)
    assert (do_transposed is None) == (bwd == "mosaic"), do_transposed
    assert triton_named(text, "qat_attention_fwd") == (fwd == "triton")
    assert mosaic_named(text, "qat_attention_fwd") == (fwd == "mosaic")
    for name in ("qat_bwd_dkdv", "qat_bwd_dq"):
        assert triton_named(text, name) == (bwd == "triton")
    if bwd == "mosaic":  # the fused dK/dV kernel reduce-adds dQ with TMA: no separate dQ kernel
        kernels = (fwd == "mosaic") + (1 if opts.config.fuses_dq(d, causal) else 2)
        assert text.count("mosaic_gpu_v2(") == kernels, (text.count("mosaic_gpu_v2("), kernels)
        fused = opts.config.fuses_dq(d, causal)
        assert mosaic_named(text, "qat_bwd_dkdv_dq" if fused else "qat_bwd_dkdv")
        assert mosaic_named(text, "qat_bwd_dq") != fused
        # the fused dQ's accumulator starts after dO exists: as |dO|·0, computed from the padded dO the kernel reads
        assert "stablehlo.optimization_barrier" not in text
        sq_pad = 384
        assert bool(re.search(rf"stablehlo.abs %\S+ : tensor<2x{sq_pad}x8x{d}xf32>", text)) == fused


def _int8_register_operand_kernel(k: int, n: int):
    """(a (64, k), e (k, k), b (n, k)) int8 → int32 (a·eᵀ)·bᵀ, where a·eᵀ is an INT32 ``wgmma`` result (the
    accumulator's layout) cast to int8 and fed to the second ``wgmma`` from registers
    (``register_operands.register_operand``)."""
    from pallas_kernels import _mosaic as mos
    from pallas_kernels.register_operands import register_operand

    def body(a_ref, e_ref, b_ref, o_ref, a_s, e_s, b_s, o_s, bar):
        for i, (src, dst) in enumerate(((a_ref, a_s), (e_ref, e_s), (b_ref, b_s))):
            mos.plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
            mos.plgpu.barrier_wait(bar.at[i])
        t8 = mos.matmul((64, k), jnp.int32, a_s, e_s.T).astype(jnp.int8)
        o_s[...] = mos.matmul((64, n), jnp.int32, register_operand(t8, None, False), b_s.T)
        mos.copy_out(((o_s, o_ref),))

    i8 = jnp.int8
    tiles = lambda rows, cols: mos.plgpu.SMEM((rows, cols), i8, transforms=mos.tile_transforms(i8, cols))  # noqa: E731
    return mos.plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, n), jnp.int32),
                            scratch_types=[tiles(64, k), tiles(k, k), tiles(n, k), mos.plgpu.SMEM((64, n), jnp.int32),
                                           mos.plgpu.Barrier(num_barriers=3)],
                            compiler_params=mos.compiler_params())


@pytest.mark.parametrize("k,n", [(64, 64), (128, 64), (64, 128)])
def test_int8_register_operand_relayout(monkeypatch, k, n):
    """An INT8 tile in the accumulator's layout reaches ``wgmma`` as a register operand through
    ``register_operands._wgmma_to_8bit`` (the relayout jax 0.11.2 lacks): it lowers for an H200 and takes that path;
    on a Hopper GPU the product is also compared exactly with numpy (a column permutation, then a matmul)."""
    import numpy as np

    from pallas_kernels import _mosaic as mos
    from pallas_kernels import register_operands

    calls = []
    relayout = register_operands._wgmma_to_8bit
    monkeypatch.setattr(register_operands, "_wgmma_to_8bit", lambda x: calls.append(x.shape) or relayout(x))
    rng = np.random.default_rng(k + n)
    a = rng.integers(-127, 128, (64, k)).astype(np.int8)
    perm = rng.permutation(k)
    e = np.eye(k, dtype=np.int8)[perm]  # a·eᵀ = a[:, perm]
    b = rng.integers(-127, 128, (n, k)).astype(np.int8)
    kernel = _int8_register_operand_kernel(k, n)
    lower_for_h200(kernel, a, e, b)
    assert calls == [(64, k)]
    if mos.on_hopper():
        want = a[:, perm].astype(np.int32) @ b.astype(np.int32).T
        np.testing.assert_array_equal(np.asarray(kernel(a, e, b)), want)


def test_warpgroup_barrier_emits_a_bar_sync(monkeypatch):
    """``_mosaic.warpgroup_barrier`` lowers to the warpgroup's ``bar.sync`` (until the fifty-third session it built
    its inline block without calling it, and emitted nothing), also in a kernel compiled without Pallas's own
    barriers (``compiler_params(manual_barriers=True)``): one more call of Mosaic GPU's barrier than the same kernel
    without it."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    from pallas_kernels import _mosaic as mos

    calls = []
    real = mgpu_utils.warpgroup_barrier
    monkeypatch.setattr(mgpu_utils, "warpgroup_barrier", lambda: calls.append(1) or real())
    f32 = jnp.float32

    def kernel(with_barrier: bool):
        def body(x_ref, o_ref, smem, bar):
            mos.plgpu.copy_gmem_to_smem(x_ref, smem, bar.at[0])
            mos.plgpu.barrier_wait(bar.at[0])
            if with_barrier:
                mos.warpgroup_barrier(False)
            mos.copy_out(((smem, o_ref),))

        return mos.plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), f32),
                                scratch_types=[mos.plgpu.SMEM((64, 64), f32), mos.plgpu.Barrier(num_barriers=1)],
                                compiler_params=mos.compiler_params(manual_barriers=True))

    counts = []
    for with_barrier in (False, True):
        calls.clear()
        lower_for_h200(kernel(with_barrier), jax.ShapeDtypeStruct((64, 64), f32))
        counts.append(len(calls))
    assert counts[1] == counts[0] + 1, counts


def _compiler_params_asked(monkeypatch) -> list[bool]:
    """A spy on ``_mosaic.compiler_params``: the list it returns gets each call's ``manual_barriers``, in launch
    order."""
    from pallas_kernels import _mosaic as mos

    asked, real = [], mos.compiler_params
    monkeypatch.setattr(mos, "compiler_params", lambda **kw: asked.append(kw.get("manual_barriers", False))
                        or real(**kw))
    return asked


@pytest.mark.parametrize("d, causal", [(64, False), (64, True), (128, True)])
def test_qat_backward_places_its_own_barriers(monkeypatch, d, causal):
    """``qat_bwd_mosaic.manual_barriers``: where FQ(P) comes last (head dim 128; 64 non-causal) the fused dK/dV/dQ
    kernel is compiled without Pallas's automatic barriers and places one warpgroup barrier per step, after S and dP
    are waited for; at head dim 64 causal Pallas's barriers stay and the step adds none. Either way one barrier
    precedes the epilogue's stores of dK and dV into the K̃ and Ṽ tiles. Checked on the lowering for an H200
    (compiler params of each Mosaic GPU kernel, the kernel's barrier calls)."""
    from h200 import lower_mosaic_fwd_bwd
    from pallas_kernels import qat_bwd_mosaic

    params, barriers = _compiler_params_asked(monkeypatch), []
    monkeypatch.setattr(qat_bwd_mosaic, "warpgroup_barrier", lambda interpret: barriers.append(interpret))
    jax.clear_caches()
    lower_mosaic_fwd_bwd("qat", d, causal, dq_kernel="fused", seq=256)
    jax.clear_caches()
    manual = qat_bwd_mosaic.manual_barriers(d, causal)
    assert manual == (d == 128 or not causal)
    assert params == [False, manual], params  # the forward, then the dK/dV/dQ kernel
    # one before the epilogue's stores into the K̃/Ṽ tiles either way; manual: one more in the (once traced) step
    assert barriers == [False] * (2 if manual else 1), barriers


@pytest.mark.parametrize("d, causal", [(64, False), (64, True), (128, False)])
def test_sage_backward_drops_pallas_barriers_at_head_dim_64(monkeypatch, d, causal):
    """``sage_bwd_mosaic.manual_barriers``: the fused dK/dV/dQ kernel is compiled without Pallas's automatic
    barriers at head dim 64 (causal or not) and with them at 128; the forward always with them. Checked on the
    lowering for an H200 (the compiler params each Mosaic GPU kernel asks for, in launch order)."""
    from h200 import lower_mosaic_fwd_bwd
    from pallas_kernels import sage_bwd_mosaic

    params = _compiler_params_asked(monkeypatch)
    jax.clear_caches()
    lower_mosaic_fwd_bwd("sage", d, causal, seq=256)
    jax.clear_caches()
    assert sage_bwd_mosaic.manual_barriers(d, fused_dq=True, interpret=False) == (d == 64)
    assert not sage_bwd_mosaic.manual_barriers(d, fused_dq=True, interpret=True)
    assert params == [False, d == 64], params  # the forward, then the dK/dV/dQ kernel


def test_8bit_layouts_are_the_ones_the_relayout_assumes():
    """``register_operands._wgmma_to_8bit`` hard-codes where each lane's bytes sit in the two layouts (jax 0.11.2): lane
    4·r + c holds columns 2c, 2c+1 of each 8-column group (WGMMA) and 4c…4c+3 of each 16-column group
    (WGMMA_8BIT), rows alike. On the pinned jax they match and the relayout is installed; a jax that lays them
    out otherwise must leave it uninstalled (the kernels then keep those operands in SMEM)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    from pallas_kernels import register_operands as mos

    assert (fa.WGMMA_LAYOUT, fa.WGMMA_LAYOUT_8BIT) == mos._expected_8bit_layouts(fa)
    assert fa.WGMMA_LAYOUT.registers_shape((64, 64))[:2] == (1, 8)  # the register index the relayout walks
    assert fa.WGMMA_LAYOUT_8BIT.registers_shape((64, 64))[:2] == (1, 4)
    assert mos.relayout_8bit() and mos.int8_in_registers(False) and not mos.int8_in_registers(True)
    assert mos._install_8bit_relayout()  # idempotent: installed once, reported again


def test_relayout_is_not_installed_over_other_layouts(monkeypatch):
    """If jax's WGMMA_8BIT were laid out otherwise, nothing is patched (the caller keeps the SMEM path)."""
    from jax.experimental.mosaic.gpu import constraints
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    from pallas_kernels import register_operands as mos

    unpatched = fa.FragmentedArray.to_layout._lowbit_original
    monkeypatch.setattr(fa.FragmentedArray, "to_layout", unpatched)
    monkeypatch.setattr(fa, "WGMMA_LAYOUT_8BIT", fa.WGMMA_LAYOUT_UPCAST_2X)
    supported = constraints._is_supported_tiled_relayout
    assert not mos._install_8bit_relayout()
    assert fa.FragmentedArray.to_layout is unpatched and constraints._is_supported_tiled_relayout is supported


@pytest.mark.parametrize("method", ["sage", "qat"])
@pytest.mark.parametrize("d,norm", [(64, True), (128, False)])
def test_the_qk_prologue_lowers_to_triton(method, d, norm):
    """QK-norm and RoPE inside sage's quantize kernels or Attn-QAT's fake quantization, and their backward pass,
    lower for the H200 (beside the Mosaic GPU attention kernels)."""
    from lowbit_jax import qat as qat_mod

    b, s, hq, hkv = 2, 300, 4, 2
    q, kv = jnp.zeros((b, s, hq, d), jnp.bfloat16), jnp.zeros((b, s, hkv, d), jnp.bfloat16)
    cos, sin = lb.rope_tables(jnp.arange(s), d)
    g = jnp.ones((d,), jnp.bfloat16) if norm else None
    pro = lb.QKPrologue(g, g, cos, sin, cos, sin)
    if method == "sage":
        opts = sage_mod.resolve_options(q, kv, kv, causal=True, implementation="pallas", interpret=True, prologue=pro)
        attend, kernels = sage_mod._sage_attention, ("sage_channel_stats", "sage_quantize_q", "sage_quantize_kv")
    else:
        config = dataclasses.replace(lb.qat_config(d, True, "NVIDIA H200"), fwd_backend="mosaic",
                                     bwd_backend="mosaic")
        opts = qat_mod.resolve_qat_options(q, kv, kv, causal=True, implementation="pallas", interpret=True,
                                           config=config, prologue=pro)
        attend, kernels = qat_mod._qat_attention, ("fp4_fake_quant",)
    opts = dataclasses.replace(opts, interpret=False)

    def grads(q, k, v, cos, sin, do):
        pro = lb.QKPrologue(g, g, cos, sin, cos, sin)
        return jax.vjp(lambda q, k, v, pro: attend(q, k, v, pro, opts), q, k, v, pro)[1](do)

    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    text = lower_for_h200(grads, spec(q.shape), spec(kv.shape), spec(kv.shape), spec(cos.shape, jnp.float32),
                          spec(sin.shape, jnp.float32), spec(q.shape))
    for name in (*kernels, "qk_prologue_bwd"):
        assert triton_named(text, name), name


def test_packed_instructions_refuse_other_dtypes_and_inexact_constants():
    """``lane_groups.packed_fma`` emits ``fma.rn.bf16x2`` on 16-bit pairs: other tile dtypes and a factor bfloat16
    cannot hold exactly are refused before anything is built."""
    from pallas_kernels import lane_groups

    bf16, f32 = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.float32)
    with pytest.raises(TypeError, match="bfloat16 tiles"):
        lane_groups.packed_fma(f32, 64.0, f32)
    with pytest.raises(TypeError, match="bfloat16 tiles"):
        lane_groups.packed_fma(bf16, 64.0, f32)
    with pytest.raises(ValueError, match="bfloat16 value"):
        lane_groups.packed_fma(bf16, 0.1, bf16)
