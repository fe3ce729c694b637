"""ThriftAttention: selection kernel ↔ reference ↔ brute force; prefill and decode kernels (interpret on
CPU) ↔ xla twins ↔ exact attention; the KV cache's 4-bit parts ↔ the NVFP4 quantizer."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import INTERPRET, AttentionTestBase, cotangent, exact_attention_f64, make_qkv, metrics
from lowbit_jax import thrift as thrift_mod
from lowbit_jax import thrift_backends
from pallas_kernels.numerics import nvfp4
from lowbit_jax.thrift_reference import (
    block_means,
    decode_rows,
    dequantized_cache,
    prefill_reference,
    topk_count,
    valid_key_blocks,
)

SMALL = lb.ThriftConfig(block=32, quant_block=32, decode_splits=4, decode_splits_high=8)


def thrift(q, k, v, impl, **options):
    options.setdefault("config", SMALL)
    return lb.thrift_attention(q, k, v, implementation=impl, interpret=INTERPRET if impl == "pallas" else False,
                               **options)


# ----------------------------------------------------------------------------- the selection rule


def test_topk_count_rule():
    full = np.full(10, 10)
    assert topk_count(0.0, full, False) == 0
    assert topk_count(0.05, full, False) == 1  # max(1, round(0.5)) with half up
    assert topk_count(0.25, full, False) == 3  # round(2.5) half up
    assert topk_count(1.0, full, False) == 10
    counts = valid_key_blocks(320, 320, 32, True)  # 10 query blocks, 1..10 valid key blocks
    np.testing.assert_array_equal(counts, np.arange(1, 11))
    for f in (0.05, 0.1, 0.25, 0.5):
        k = topk_count(f, counts, True)
        got = np.minimum(k, counts).sum()
        others = [abs(np.minimum(j, counts).sum() - f * counts.sum()) for j in range(1, 11)]
        assert abs(got - f * counts.sum()) == min(others) and k >= 1
    assert topk_count(1.0, counts, True) == 10 and topk_count(0.0, counts, True) == 0


def test_valid_key_blocks_bottom_right():
    # chunked prefill: 64 queries at the end of 200 keys, blocks of 32
    np.testing.assert_array_equal(valid_key_blocks(64, 200, 32, True), [6, 7])
    # Sq > Sk: the first query blocks see no key at all
    np.testing.assert_array_equal(valid_key_blocks(100, 40, 32, True), [0, 1, 2, 2])
    np.testing.assert_array_equal(valid_key_blocks(100, 40, 32, False), [2, 2, 2, 2])


def brute_force_selection(q, k, block, causal, budget):
    """Selection by numpy from the SPEC's words: block means, scores, the top k by a stable sort."""
    qm = np.asarray(block_means(q, block), np.float64)
    km = np.asarray(block_means(k, block), np.float64)
    km = np.repeat(km, q.shape[2] // k.shape[2], axis=1)
    scores = np.einsum("bhqd,bhkd->bhqk", qm, km)
    counts = valid_key_blocks(q.shape[1], k.shape[1], block, causal)
    kk = topk_count(budget, counts, causal)
    out = np.zeros(scores.shape, bool)
    for idx in np.ndindex(*scores.shape[:3]):
        n = counts[idx[2]]
        order = np.argsort(-scores[idx][:n], kind="stable")[: min(kk, n)]
        out[idx + (order,)] = True
    return out


SELECT_CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal): ragged, but every block's row count a power of two
    (1, 100, 80, 4, 2, 64, True),
    (2, 96, 296, 2, 1, 32, False),
    (1, 200, 200, 2, 2, 128, True),
]


@pytest.mark.parametrize("case", SELECT_CASES)
@pytest.mark.parametrize("budget", [0.0, 0.1, 0.3, 1.0])
def test_selection_kernel_equals_reference_on_exact_scores(case, budget):
    """Integer-valued q, k (small range, many exact ties): every score is exact in float32 whatever the
    summation order, so the kernel's bisection must give the reference's top-k bit for bit, ties to the
    lower index included; both equal the numpy brute force."""
    b, sq, sk, hq, hkv, d, causal = case
    rng = np.random.default_rng(sq + sk + d)
    block = SMALL.block
    # small integers times the block size: each block's mean (its row count a power of two) is exact, and so
    # is every score
    q = jnp.asarray(rng.integers(-2, 3, (b, sq, hq, d)) * block, jnp.float32)
    k = jnp.asarray(rng.integers(-1, 2, (b, sk, hkv, d)) * block, jnp.float32)
    opts = dict(causal=causal, budget=budget, config=SMALL)
    got = lb.thrift_select(q, k, implementation="pallas", interpret=INTERPRET, **opts)
    ref = lb.thrift_select(q, k, implementation="xla", **opts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(ref), brute_force_selection(q, k, block, causal, budget))


def test_selection_kernel_several_chunks():
    """Rows longer than one scoring chunk (select_chunk=16, 35 key blocks): the recomputed chunks and the
    running tie count across chunks give the brute-force selection (exact integer scores, many ties)."""
    cfg = lb.ThriftConfig(block=32, select_chunk=16, select_whole=16)
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.integers(-1, 2, (1, 64, 2, 64)) * 32, jnp.float32)
    k = jnp.asarray(rng.integers(-1, 2, (1, 1104, 1, 64)) * 32, jnp.float32)
    for causal in (False, True):
        for budget in (0.1, 0.5):
            kw = dict(causal=causal, budget=budget, config=cfg)
            got = lb.thrift_select(q, k, implementation="pallas", interpret=INTERPRET, **kw)
            np.testing.assert_array_equal(np.asarray(got), brute_force_selection(q, k, 32, causal, budget))


def test_selection_on_random_inputs():
    q, k, _ = make_qkv(1, 256, 512, 4, 2, 64, dtype=jnp.bfloat16, seed=2)
    for causal in (False, True):
        kw = dict(causal=causal, budget=0.25, config=SMALL)
        got = np.asarray(lb.thrift_select(q, k, implementation="pallas", interpret=INTERPRET, **kw))
        ref = np.asarray(lb.thrift_select(q, k, implementation="xla", **kw))
        np.testing.assert_array_equal(got, ref)
        counts = valid_key_blocks(256, 512, 32, causal)
        want = np.minimum(topk_count(0.25, counts, causal), counts)
        np.testing.assert_array_equal(ref.sum(-1), np.broadcast_to(want, ref.shape[:3]))
        if causal:  # never beyond the diagonal
            cols = np.arange(ref.shape[-1])
            assert not np.any(ref & (cols[None, :] >= counts[:, None]))


# ----------------------------------------------------------------------------- prefill


class ThriftXla(AttentionTestBase):
    implementation = "xla"
    min_cos = 0.98  # FP4 for most blocks: the Attn-QAT-level accuracy on N(0,1)
    max_rel_l1 = 0.2

    def run(self, q, k, v, **options):
        return thrift(q, k, v, self.implementation, **options)


class TestThriftXla(ThriftXla):
    @pytest.mark.parametrize("case", AttentionTestBase.AWKWARD_CASES)
    def test_close_to_exact(self, case):
        self.check_awkward_case(case)

    def test_empty_rows_are_zero(self):
        q, k, v = make_qkv(1, 80, 30, 2, 2, 64, seed=7)
        out = self.run(q, k, v, causal=True, budget=0.5)
        np.testing.assert_array_equal(np.asarray(out[:, :50], np.float32), 0.0)
        assert np.all(np.abs(np.asarray(out[:, 50:], np.float32)).sum(-1) > 0)

    @pytest.mark.parametrize("case", AttentionTestBase.AWKWARD_CASES[:2])
    def test_full_budget_is_16bit_attention(self, case):
        b, sq, sk, hq, hkv, d, causal = case
        q, k, v = make_qkv(b, sq, sk, hq, hkv, d, seed=11)
        self.assert_close_to_exact(self.run(q, k, v, causal=causal, budget=1.0), q, k, v, causal=causal,
                                   min_cos=0.99999, max_rel_l1=0.006)


class TestThriftPallas(TestThriftXla):
    implementation = "pallas"


PREFILL_CASES = [case + (budget,) for case, budget in zip(AttentionTestBase.AWKWARD_CASES, (0.0, 0.1, 1.0, 0.3))]


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_kernel_matches_xla(case):
    b, sq, sk, hq, hkv, d, causal, budget = case
    dtype = jnp.float16 if budget == 0.1 else jnp.bfloat16
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=sq + sk)
    got = thrift(q, k, v, "pallas", causal=causal, budget=budget)
    ref = thrift(q, k, v, "xla", causal=causal, budget=budget)
    assert got.dtype == dtype and got.shape == q.shape
    assert metrics(got, ref)[1] < 2e-3  # same quantization and selection; accumulation order only


def test_chunked_prefill_is_the_one_call_prefill():
    """ThriftConfig.prefill_chunk changes no value: 35 query blocks of 32 in chunks of 16 (two chunks through the
    fori_loop, with the first block traced, and a remainder of 3), causal with Sq < Sk, equal bit for bit to
    one call over all blocks (and so to the twin, which other tests hold the one-call kernels to)."""
    q, k, v = make_qkv(1, 1100, 1300, 2, 1, 64, seed=5)
    kw = dict(causal=True, budget=0.1)
    one = thrift(q, k, v, "pallas", **kw)
    chunked = thrift(q, k, v, "pallas", config=dataclasses.replace(SMALL, prefill_chunk=16), **kw)
    np.testing.assert_array_equal(np.asarray(chunked, np.float32), np.asarray(one, np.float32))
    assert metrics(one, thrift(q, k, v, "xla", **kw))[1] < 2e-3


def test_operand_pass_matches_reference():
    from lowbit_jax.thrift_reference import fake_quant_operand
    from pallas_kernels.fake_quant import fp4_fake_quant_heads

    _, k, _ = make_qkv(2, 8, 90, 2, 2, 64, seed=4)
    for along in ("channels", "tokens"):
        got = fp4_fake_quant_heads(k, seq_pad=128, block=32, along=along, out_dtype=jnp.bfloat16,
                                   interpret=INTERPRET)
        ref = fake_quant_operand(k, seq_pad=128, along=along, dtype=jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    with pytest.raises(ValueError, match="along"):
        fp4_fake_quant_heads(k, seq_pad=128, block=32, along="heads", out_dtype=jnp.bfloat16, interpret=INTERPRET)
    # the tokens variant groups 16 consecutive tokens per channel: one group's scale from its own amax
    vt = np.asarray(ref[0, 0, :16, 0], np.float32)
    raw = np.asarray(k[0, :16, 0, 0], np.float32)
    np.testing.assert_array_equal(vt, np.asarray(nvfp4.fake_quant(jnp.asarray(raw)), np.float32))


def test_uniform_fp4_single_block_matches_the_spec_formula():
    """f = 0 with all keys in one block (a single online-softmax step): O = FQ(P)·Ṽ / Σ P with Q̃, K̃ = φ
    per token along D, Ṽ = φ per 16 tokens, P relative to the row max — written here from the public
    quantizer on whole arrays, independently of the kernels' tiling."""
    q, k, v = make_qkv(1, 40, 48, 2, 1, 64, dtype=jnp.bfloat16, seed=9)
    cfg = lb.ThriftConfig(block=64, quant_block=64)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    qt, kt = nvfp4.fake_quant(f32(q), axis=-1), nvfp4.fake_quant(f32(k), axis=-1)
    vt = nvfp4.fake_quant(f32(v), axis=1)  # 48 tokens: three groups of 16
    s = jnp.einsum("bqhd,bkhd->bhqk", qt, jnp.repeat(kt, 2, axis=2)) * 64**-0.5
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    pq = nvfp4.fake_quant(p, axis=-1)
    want = jnp.einsum("bhqk,bkhd->bqhd", pq.astype(jnp.bfloat16).astype(jnp.float32), jnp.repeat(vt, 2, axis=2))
    want = want / jnp.swapaxes(jnp.sum(p, axis=-1), 1, 2)[..., None]
    for impl in ("xla", "pallas"):
        got = thrift(q, k, v, impl, budget=0.0, config=cfg)
        assert metrics(got, want)[1] < 4e-3, impl  # exp vs exp2 and bf16 output rounding only


def heavy_hitter_inputs(seed, s=512, heads=2, d=64, hot=3, block=32):
    """Keys whose few 'hot' blocks align with the queries: most of the attention mass sits there."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, s, heads, d))
    k = rng.standard_normal((1, s, heads, d))
    v = rng.standard_normal((1, s, heads, d))
    u = rng.standard_normal(d)
    q += 0.6 * u
    for blk in rng.choice(s // block, hot, replace=False):
        k[0, blk * block:(blk + 1) * block] += 0.6 * u
    return tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))


def test_selection_beats_random_blocks():
    """The point of the method: at the same budget, the selected blocks cut the FP4 error far more than
    a random choice of blocks (and f = 1 removes it)."""
    q, k, v = heavy_hitter_inputs(0)
    exact = exact_attention_f64(q, k, v)
    err = lambda o: float(np.linalg.norm(np.asarray(o, np.float64) - exact) / np.linalg.norm(exact))  # noqa: E731
    e0, e10, e100 = (err(thrift(q, k, v, "xla", budget=f)) for f in (0.0, 0.1, 1.0))
    opts = thrift_mod.resolve_thrift_options(q, k, v, budget=0.1, implementation="xla", config=SMALL)
    ops = thrift_mod.operands(k, v, opts)
    sel = thrift_mod._selection(q, k, opts)
    rng = np.random.default_rng(1)
    random_sel = jnp.asarray(np.stack([rng.permutation(np.asarray(row)) for row in sel.reshape(-1, sel.shape[-1])])
                             .reshape(sel.shape))
    e_rand = err(prefill_reference(q, *ops, random_sel, sq_len=512, sk_len=512, causal=False, scale=64**-0.5,
                                   config=SMALL, out_dtype=q.dtype))
    assert e100 < 0.01 < e10 < e0
    assert e10 < 0.6 * e_rand, (e10, e_rand, e0)


def test_gradient_is_exact_attentions():
    q, k, v = make_qkv(1, 70, 90, 4, 2, 64, dtype=jnp.float32, seed=3)
    loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent(q)))  # noqa: E731
    g = jax.jit(jax.grad(loss(functools.partial(thrift, impl="pallas", causal=True, budget=0.1)), argnums=(0, 1, 2)))
    g_ref = jax.grad(loss(functools.partial(lb.reference_attention, causal=True)), argnums=(0, 1, 2))
    for a, r in zip(g(q, k, v), g_ref(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_under_vmap_and_jit():
    q, k, v = make_qkv(2, 64, 96, 2, 1, 32, seed=8)
    fn = jax.jit(jax.vmap(lambda q, k, v: thrift(q[None], k[None], v[None], "pallas", budget=0.25)[0]))
    got = fn(q, k, v)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(thrift(q, k, v, "pallas", budget=0.25), np.float32))


# ----------------------------------------------------------------------------- the cache and decode


def test_cache_parts_are_the_nvfp4_of_the_16bit_values():
    """Appending in steps of 1, 5 and 70 tokens (partial V groups re-quantized) gives the same 4-bit cache
    as one bulk append, and both equal φ of the 16-bit values; k̄ of complete blocks are the block means."""
    _, k, v = make_qkv(1, 4, 110, 2, 2, 64, seed=12)
    bulk = lb.ThriftKVCache.create(1, 160, 2, 64, block=32).append(k, v)
    steps = lb.ThriftKVCache.create(1, 160, 2, 64, block=32)
    for a, b in ((0, 1), (1, 6), (6, 76), (76, 110)):
        steps = jax.jit(lambda c, kn, vn: c.append(kn, vn))(steps, k[:, a:b], v[:, a:b])
    for name in ("k", "v", "k4", "v4", "k4_scale", "v4_scale"):
        np.testing.assert_array_equal(np.asarray(getattr(steps, name), np.float32),
                                      np.asarray(getattr(bulk, name), np.float32), err_msg=name)
    assert int(steps.length) == 110
    kf, vf = dequantized_cache(bulk.k4, bulk.k4_scale, bulk.v4, bulk.v4_scale, 32)
    pad = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 50), (0, 0), (0, 0)))  # noqa: E731
    np.testing.assert_array_equal(np.asarray(kf), np.asarray(jnp.swapaxes(nvfp4.fake_quant(pad(k), axis=-1), 1, 2)))
    np.testing.assert_array_equal(np.asarray(vf), np.asarray(jnp.swapaxes(nvfp4.fake_quant(pad(v), axis=1), 1, 2)))
    np.testing.assert_allclose(np.asarray(bulk.k_mean[:, :, :3]), np.asarray(block_means(k, 32)[:, :, :3]),
                               rtol=1e-6, atol=1e-7)
    assert bulk.nbytes()["4bit"] * 2 == pytest.approx(0.5625 * bulk.nbytes()["16bit"])


def filled_cache(k, v, n, block=32, max_len=256):
    return lb.ThriftKVCache.create(k.shape[0], max_len, k.shape[2], k.shape[3], dtype=k.dtype,
                                   block=block).append(k[:, :n], v[:, :n])


DECODE_CASES = [  # (B, filled before, T new, Hq, Hkv, D, budget)
    (2, 150, 1, 4, 2, 64, 0.3),
    (1, 77, 3, 8, 2, 128, 0.0),
    (1, 77, 3, 8, 2, 128, 1.0),
    (1, 30, 2, 2, 2, 64, 0.5),  # no complete block before the new tokens
    (1, 100, 3, 4, 2, 64, 0.3),  # 6 rows: the softmax on the first 8 of the 16-row tile, 2 of them padding
    (2, 120, 1, 2, 2, 128, 0.2),  # MHA, one token: one softmax row
]


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_kernel_matches_xla(case):
    b, n, t, hq, hkv, d, budget = case
    q, k, v = make_qkv(b, n + t, n + t, hq, hkv, d, seed=n + t)
    cache = filled_cache(k, v, n).append(k[:, n:], v[:, n:])
    kw = dict(budget=budget, config=SMALL)
    got = lb.thrift_decode(q[:, n:], cache, implementation="pallas", interpret=INTERPRET, **kw)
    ref = lb.thrift_decode(q[:, n:], cache, implementation="xla", **kw)
    assert got.shape == (b, t, hq, d) and got.dtype == q.dtype
    assert metrics(got, ref)[1] < 2e-3
    exact = exact_attention_f64(q[:, n:], k, v, causal=True)
    assert metrics(ref, exact)[0] > 0.975  # FP4 for most keys at the least


def test_decode_with_one_split_is_the_prefill_last_row_at_zero_budget():
    """Uniform FP4 decode of the last token, one split, equals the causal prefill's last row (same Q̃, K̃,
    Ṽ, the same key blocks in the same order): the cache layout and the prefill operands agree."""
    q, k, v = make_qkv(1, 150, 150, 4, 2, 64, seed=21)
    cfg = lb.ThriftConfig(block=32, quant_block=32, decode_splits=1)
    cache = filled_cache(k, v, 150)
    for impl in ("xla", "pallas"):
        dec = lb.thrift_decode(q[:, -1:], cache, budget=0.0, config=cfg, implementation=impl, interpret=INTERPRET)
        pre = thrift(q, k, v, impl, causal=True, budget=0.0, config=cfg)[:, -1:]
        assert metrics(dec, pre)[1] < 2e-3, impl


def test_decode_full_budget_on_whole_blocks_is_16bit():
    """f = 1 with the cache filled to whole blocks: every block 16-bit whatever the splits (4 of them)."""
    q, k, v = make_qkv(1, 128, 128, 4, 1, 64, seed=22)
    cache = filled_cache(k, v, 128)
    exact = exact_attention_f64(q[:, -1:], k, v, causal=True)
    for impl in ("xla", "pallas"):
        got = lb.thrift_decode(q[:, -1:], cache, budget=1.0, config=SMALL, implementation=impl, interpret=INTERPRET)
        cos, rel = metrics(got, exact)
        assert cos > 0.99999 and rel < 0.006, (impl, cos, rel)


def test_decode_selection_is_the_top_blocks_by_max_over_heads():
    from lowbit_jax.thrift_reference import decode_selection

    q, k, v = make_qkv(1, 200, 200, 4, 2, 64, seed=23)
    cache = filled_cache(k, v, 200)
    sel = np.asarray(decode_selection(q[:, -2:], cache.k_mean, cache.length, budget=0.5, block=32))
    rows = np.asarray(q[:, -2:], np.float64).reshape(1, 2, 2, 2, 64)  # (B, T, Hkv, G, D)
    km = np.asarray(block_means(k, 32), np.float64)[:, :, :6]  # 6 complete blocks of 32 in 200 tokens
    scores = np.einsum("bthgd,bhkd->bhtgk", rows, km).max(axis=(2, 3))
    for h in range(2):
        want = np.zeros(cache.k_mean.shape[2], bool)
        want[np.argsort(-scores[0, h], kind="stable")[:3]] = True  # round(0.5 · 6)
        np.testing.assert_array_equal(sel[0, h], want)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(budget=1.5), ValueError, "budget must be in"),
    (dict(budget=-0.1), ValueError, "budget must be in"),
    (dict(budget="all"), TypeError, "budget must be a number"),
    (dict(budget=True), TypeError, "budget must be a number"),
    (dict(config=lb.QatConfig()), TypeError, "config must be a ThriftConfig"),
    (dict(scale=0.0), ValueError, "scale must be finite and positive"),
    (dict(implementation="cuda"), ValueError, "implementation must be one of"),
])
def test_bad_options(kwargs, err, match):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64)
    with pytest.raises(err, match=match):
        lb.thrift_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("fields, match", [
    (dict(block=16), "ThriftConfig.block"),
    (dict(decode_splits=3), "power of two"),
    (dict(select_rows=8), "select_rows"),
    (dict(prefill_chunk=8), "prefill_chunk .* must be a multiple of select_rows"),
    (dict(prefill_chunk=48), "prefill_chunk must be a power of two"),
    (dict(decode_stages=0), "decode_stages must be an integer >= 1"),
    (dict(decode_warps=3), "decode_warps must be a power of two"),
])
def test_bad_config(fields, match):
    with pytest.raises(ValueError, match=match):
        lb.ThriftConfig(**fields)


def test_bad_shapes_and_configs():
    q, k, v = make_qkv(1, 8, 8, 3, 2, 64)
    with pytest.raises(ValueError, match="multiple of the number of k/v heads"):
        lb.thrift_attention(q, k, v)
    with pytest.raises(ValueError, match="rank 4"):
        lb.thrift_select(q[0], k)
    long_kv = jax.ShapeDtypeStruct((1, 2**15 * 32 + 1, 1, 64), jnp.bfloat16)  # never allocated: checked first
    with pytest.raises(ValueError, match="more than 32768 key blocks"):
        thrift_mod.resolve_thrift_options(q[:, :, :1], long_kv, long_kv, config=lb.ThriftConfig(block=32))


def test_bad_cache_and_decode_arguments():
    cache = lb.ThriftKVCache.create(1, 64, 2, 64, block=32)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        lb.ThriftKVCache.create(1, 64, 2, 48)
    with pytest.raises(ValueError, match="block must be"):
        lb.ThriftKVCache.create(1, 64, 2, 64, block=48)
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        lb.ThriftKVCache.create(1, 0, 2, 64)
    with pytest.raises(TypeError, match="dtype must be"):
        lb.ThriftKVCache.create(1, 64, 2, 64, dtype=jnp.int8)
    with pytest.raises(ValueError, match="max_len .* more than 32768 key blocks"):
        lb.ThriftKVCache.create(1, 2**15 * 32 + 1, 2, 64, block=32)
    with pytest.raises(ValueError, match="kv_heads/head_dim"):
        cache.append(jnp.zeros((1, 2, 4, 64)), jnp.zeros((1, 2, 4, 64)))
    with pytest.raises(ValueError, match="appending 65 tokens"):
        cache.append(jnp.zeros((1, 65, 2, 64)), jnp.zeros((1, 65, 2, 64)))
    cache = cache.append(jnp.ones((1, 3, 2, 64)), jnp.ones((1, 3, 2, 64)))
    with pytest.raises(TypeError, match="cache must be a ThriftKVCache"):
        lb.thrift_decode(jnp.zeros((1, 1, 2, 64)), {"k": 0})
    with pytest.raises(ValueError, match="multiple of the cache's kv heads"):
        lb.thrift_decode(jnp.zeros((1, 1, 3, 64)), cache)
    with pytest.raises(ValueError, match="must match the cache's"):
        lb.thrift_decode(jnp.zeros((1, 1, 2, 128)), cache)
    with pytest.raises(ValueError, match="must equal the cache's block"):
        lb.thrift_decode(jnp.zeros((1, 1, 2, 64)), cache, config=lb.ThriftConfig(block=64))
    with pytest.raises(ValueError, match="at most 1024 query rows"):
        lb.thrift_decode(jnp.zeros((1, 1025, 2, 64)), cache, config=SMALL)


@pytest.mark.parametrize("shape", [(3, 5, 17), (2, 64), (1, 4, 300)])
def test_block_order_and_top_blocks_match_sorting(shape):
    """block_order (prefix counts and a scatter, no sort) is numpy's stable sort of the keys "4-bit valid, then
    16-bit valid, then invalid, each ascending"; _top_blocks (one sort, an inverse permutation by a scatter)
    keeps the ``take`` best valid blocks, ties to the lower index (integer scores: many ties)."""
    from lowbit_jax.thrift_reference import _top_blocks, block_order

    rng = np.random.default_rng(sum(shape))
    nkb = shape[-1]
    sel = rng.random(shape) < 0.3
    counts = rng.integers(0, nkb + 1, shape[:-1])
    got = np.asarray(block_order(jnp.asarray(sel), jnp.asarray(counts)))
    j = np.arange(nkb)
    key = np.where(j >= counts[..., None], 2 * nkb + j, np.where(sel, nkb + j, j))
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, np.argsort(key, axis=-1, kind="stable"))
    scores = rng.integers(0, 4, shape).astype(np.float32)
    valid = j < counts[..., None]
    take = rng.integers(0, nkb + 1, shape[:-1])[..., None]
    rank = np.argsort(np.argsort(np.where(valid, -scores, np.inf), axis=-1, kind="stable"), axis=-1)
    np.testing.assert_array_equal(np.asarray(_top_blocks(jnp.asarray(scores), jnp.asarray(valid), jnp.asarray(take))),
                                  (rank < take) & valid)


@pytest.mark.parametrize("n, n_complete, n_blocks, take", [
    (16, 16, 16, 3), (64, 40, 41, 2), (64, 40, 41, 0), (64, 40, 41, 40), (256, 0, 1, 0), (256, 200, 200, 10),
    (1024, 1000, 1001, 50)])
def test_decode_order_kernel_is_the_xla_order(n, n_complete, n_blocks, take):
    """The decode's order kernel (interpret mode) gives block_order(_top_blocks(...)) bit for bit: rows of
    integer scores (ties everywhere), ±0 and ±inf, partial last blocks (n_blocks = n_complete + 1), budgets 0
    and all; entries from n_complete on carry garbage scores that must be ignored."""
    from lowbit_jax.thrift_reference import _top_blocks, block_order
    from pallas_kernels.thrift_scalars import HEADER, N_BLOCKS, N_COMPLETE, N_HIGH
    from pallas_kernels.thrift_select import thrift_decode_order

    rng = np.random.default_rng(n + n_complete + take)
    scores = rng.integers(-3, 4, (2, 3, n)).astype(np.float32)
    scores[0, 0, :4] = [0.0, -0.0, np.inf, -np.inf]
    scores[..., n_complete:] = 1e30  # not selectable
    scalars = np.full(16 + HEADER, -7, np.int32)  # positions and unread header entries: garbage
    scalars[16 + N_COMPLETE], scalars[16 + N_HIGH], scalars[16 + N_BLOCKS] = n_complete, take, n_blocks
    got = thrift_decode_order(jnp.asarray(scores), jnp.asarray(scalars), interpret=INTERPRET)
    sel = _top_blocks(jnp.asarray(scores), jnp.arange(n) < n_complete, jnp.int32(take))
    assert got.dtype == jnp.int16 and int(jnp.sum(sel[1, 2])) == take
    np.testing.assert_array_equal(np.asarray(got), np.asarray(block_order(sel, n_blocks)))


def test_decode_order_kernel_lays_out_one_tokens_rows():
    """Given one token's queries, the order kernel also writes each kv head's rows (its group's heads, in order)
    and their fake quantization, and the same order; padding rows stay unwritten; a group that is not a power of
    two is refused."""
    from pallas_kernels.thrift_scalars import HEADER, N_BLOCKS, N_COMPLETE, N_HIGH
    from pallas_kernels.thrift_select import thrift_decode_order

    b, hkv, g, d, n, r_pad = 2, 3, 4, 64, 64, 16
    rng = np.random.default_rng(7)
    scores = jnp.asarray(rng.normal(size=(b, hkv, n)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(b, hkv * g, d)) * 3, jnp.bfloat16)
    scalars = np.zeros(r_pad + HEADER, np.int32)
    scalars[r_pad + N_COMPLETE], scalars[r_pad + N_HIGH], scalars[r_pad + N_BLOCKS] = 60, 5, 61
    order, rows, fq = thrift_decode_order(scores, jnp.asarray(scalars), q, interpret=INTERPRET)
    assert rows.shape == fq.shape == (b, hkv, r_pad, d) and rows.dtype == jnp.bfloat16 and fq.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(order),
                                  np.asarray(thrift_decode_order(scores, jnp.asarray(scalars), interpret=INTERPRET)))
    want = np.asarray(q, np.float32).reshape(b, hkv, g, d)
    np.testing.assert_array_equal(np.asarray(rows[:, :, :g], np.float32), want)
    np.testing.assert_array_equal(np.asarray(fq[:, :, :g], np.float32),
                                  np.asarray(nvfp4.fake_quant_last(jnp.asarray(want)).astype(jnp.float16), np.float32))
    with pytest.raises(ValueError, match="power of two"):
        thrift_decode_order(scores, jnp.asarray(scalars), q[:, :9], interpret=INTERPRET)


def test_decode_order_kernel_refuses_a_wrong_scalars_vector():
    from pallas_kernels.thrift_select import thrift_decode_order

    for bad in (jnp.zeros(20, jnp.int32), jnp.zeros(24, jnp.float32)):
        with pytest.raises(ValueError, match="scalars"):
            thrift_decode_order(jnp.zeros((1, 1, 64)), bad, interpret=INTERPRET)


def test_decode_order_beyond_the_kernel_is_the_same(monkeypatch):
    """lowbit_jax.thrift.decode_order: past DECODE_ORDER_MAX_BLOCKS (here lowered to 0) the XLA path gives the
    kernel's order and 16-bit count (a cache of 200 tokens in blocks of 32: 6 complete of 7, budget 0.5)."""
    from pallas_kernels import thrift_select

    q, k, v = make_qkv(2, 200, 200, 4, 2, 64, seed=31)
    cache = filled_cache(k, v, 200)
    scalars = thrift_backends.decode_scalars(q[:, -2:], cache, budget=0.5, block=32, r_pad=16)
    def run():
        return thrift_backends.decode_order(q[:, -2:], cache, scalars, interpret=INTERPRET)
    order = run()
    monkeypatch.setattr(thrift_select, "DECODE_ORDER_MAX_BLOCKS", 0)
    np.testing.assert_array_equal(np.asarray(order), np.asarray(run()))


def test_decode_scalars_hold_the_rows_positions_and_block_counts():
    """lowbit_jax.thrift_backends.decode_scalars, counted by hand: 200 cached tokens, 2 new ones, a group of 2
    heads (rows g·T + t), blocks of 32: 6 complete of 7, budget 0.5 → 3 in 16-bit, 4 in 4-bit; an overflowed
    cache is flagged unusable."""
    from pallas_kernels.thrift_scalars import HEADER, N_BLOCKS, N_COMPLETE, N_HIGH, N_LOW, USABLE

    q, k, v = make_qkv(1, 200, 200, 4, 2, 64, seed=5)
    cache = filled_cache(k, v, 200)
    got = np.asarray(thrift_backends.decode_scalars(q[:, -2:], cache, budget=0.5, block=32, r_pad=16))
    assert got.dtype == np.int32 and got.shape == (16 + HEADER,)
    np.testing.assert_array_equal(got[:16], [198, 199, 198, 199] + [-1] * 12)
    header = dict(zip((N_COMPLETE, N_HIGH, N_LOW, N_BLOCKS, USABLE), (6, 3, 4, 7, 1)))
    assert {i: int(got[16 + i]) for i in header} == header
    assert not got[16 + 5:].any()
    bad = np.asarray(thrift_backends.decode_scalars(q[:, -2:], dataclasses.replace(cache, overflow=jnp.bool_(True)),
                                                    budget=0.5, block=32, r_pad=16))
    assert bad[16 + USABLE] == 0


def test_decode_launch_by_rows_per_program():
    """ThriftConfig.decode_launch: unset warps/stages follow the query rows per program (two warps for a
    16-row tile, four warps and three stages for wider ones, as measured on the H200); set ones win, each
    on its own; thrift_decode passes its row tile (1 token × 4 heads → 16 rows, 40 tokens × 4 → 64)."""
    cfg = lb.ThriftConfig()
    assert cfg.decode_launch(16) == (2, 2) and cfg.decode_launch(64) == (4, 3)
    assert lb.ThriftConfig(decode_warps=8).decode_launch(16) == (8, 2)
    assert lb.ThriftConfig(decode_stages=1).decode_launch(64) == (4, 1)
    assert thrift_backends.decode_layout(1 * 4)[1] == 16 and thrift_backends.decode_layout(40 * 4)[1] == 64


@pytest.mark.parametrize("batch, kv_heads, head_rows, max_blocks, budget, want, own_high", [
    (8, 8, 4, 128, 0.05, (16, 2), 4),  # 64 programs a split: 16 + 2 splits fill about 1024 programs
    (2, 8, 4, 2048, 0.05, (64, 8), 64),  # fewer sequences, longer caches: more splits
    (8, 8, 4, 24, 0.05, (4, 1), 1),  # at least 4 key blocks a split
    (8, 8, 4, 128, 1.0, (1, 16), 16),  # f = 1: the 16-bit runs take the splits
    (8, 8, 4, 128, 0.0, (16, 1), 1),
    (8, 8, 160, 512, 0.05, (4, 1), 4),  # 160 rows: three 64-row tiles a head
])
def test_decode_splits_fill_the_gpu_by_call(batch, kv_heads, head_rows, max_blocks, budget, want, own_high):
    """ThriftConfig.for_decode: unset split counts are powers of two that give about DECODE_PROGRAMS programs
    (the 16-bit runs a share by the bytes the budget reads), never fewer than DECODE_MIN_BLOCKS blocks a run
    at the cache's capacity; with a launch of their own (``high_launch``) the 16-bit runs take one or two blocks
    each, up to DECODE_PROGRAMS programs, and the 4-bit runs keep their count; set ones are kept."""
    from pallas_kernels import configs

    shape = dict(batch=batch, kv_heads=kv_heads, head_rows=head_rows, max_blocks=max_blocks, budget=budget)
    cfg = lb.ThriftConfig().for_decode(**shape)
    assert (cfg.decode_splits, cfg.decode_splits_high) == want
    per_split = batch * kv_heads * -(-head_rows // 64)
    assert (cfg.decode_splits + cfg.decode_splits_high) * per_split <= 2 * configs.DECODE_PROGRAMS
    own = lb.ThriftConfig().for_decode(**shape, high_launch=True)
    assert (own.decode_splits, own.decode_splits_high) == (want[0], own_high)
    assert own_high * per_split <= configs.DECODE_PROGRAMS
    kept = lb.ThriftConfig(decode_splits=2).for_decode(**shape)
    assert kept.decode_splits == 2 and kept.decode_splits_high == want[1]
    both = lb.ThriftConfig(decode_splits=2, decode_splits_high=4)
    assert both.for_decode(**shape) is both and both.for_decode(**shape, high_launch=True) is both


def test_decode_config_gives_the_16bit_runs_their_own_fill_where_they_have_their_own_launch():
    """decode_config resolves the split counts by the backend that will run: with the Mosaic kernel taking the
    4-bit runs, the 16-bit runs' own fill; with the one Triton kernel, their share. The XLA twin resolves the same
    counts as the kernels (here both with ``decode_backend="mosaic"``), so the two agree with the splits unset."""
    from lowbit_jax import thrift as thrift_mod

    q, k, v = make_qkv(1, 1000, 1000, 8, 2, 64, seed=41)
    cache = filled_cache(k, v, 1000, block=64, max_len=1024)
    qt = q[:, -1:]
    shape = dict(batch=1, kv_heads=2, head_rows=4, max_blocks=cache.k.shape[1] // cache.block, budget=0.25)
    for backend, high_launch in (("mosaic", True), ("triton", False)):
        cfg = lb.ThriftConfig(decode_backend=backend)
        got = thrift_mod.decode_config(qt, cache, budget=0.25, config=cfg, interpret=INTERPRET)
        assert got == cfg.for_decode(**shape, high_launch=high_launch)
    assert cfg.for_decode(**shape, high_launch=True) != cfg.for_decode(**shape)  # the case tells them apart
    cfg = lb.ThriftConfig(decode_backend="mosaic")
    run = functools.partial(lb.thrift_decode, qt, cache, budget=0.25, config=cfg)
    assert metrics(run(implementation="pallas", interpret=INTERPRET), run(implementation="xla"))[1] < 2e-3


def test_combine_splits_of_two_groups_is_the_combine_of_their_concatenation():
    """Two kernels' partial softmaxes merged as groups equal the merge of their concatenation along the split axis
    to float32 rounding (the sums run in another order), empty splits (m = −inf, l = 0) included, and softmax
    attention over all the keys (float64 oracle)."""
    from lowbit_jax.thrift_reference import combine_splits

    rng = np.random.default_rng(7)
    scores = rng.normal(size=(2, 3, 40)) * 3  # (B, rows, keys)
    values = rng.normal(size=(2, 40, 8))
    bounds = [0, 7, 7, 20, 31, 40]  # five splits, the second empty

    def partial(lo, hi):
        s = scores[..., lo:hi] / np.log(2)  # base 2, as the kernels keep m
        m = s.max(axis=-1) if hi > lo else np.full(s.shape[:-1], -np.inf)
        p = np.exp2(s - m[..., None]) if hi > lo else s
        return p @ values[:, lo:hi], m, p.sum(axis=-1)

    parts = [partial(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    stack = lambda xs: jnp.asarray(np.stack(xs, axis=1), jnp.float32)  # noqa: E731
    group = lambda ps: tuple(stack([p[i] for p in ps]) for i in range(3))  # noqa: E731
    both = combine_splits(group(parts[:2]), group(parts[2:]))
    np.testing.assert_allclose(np.asarray(both), np.asarray(combine_splits(group(parts))), rtol=1e-6, atol=1e-7)
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(both), (w / w.sum(axis=-1, keepdims=True)) @ values, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("tokens, group, r_pad, d, splits", [
    (1, 4, 16, 64, (4, 2)),  # one token of a group of 4: 4 of 16 rows; power-of-two splits, merged whole
    (3, 3, 16, 96, (5, 2)),  # a group of 3, three tokens; head dim 96; 5 splits, merged one at a time
    (17, 8, 192, 32, (8, 16)),  # 136 rows in three 64-row tiles, the last mostly padding
])
def test_combine_kernel_is_combine_splits_in_the_output_layout(tokens, group, r_pad, d, splits):
    """pallas_kernels.thrift_combine.combine_decode (interpret mode) on two groups of partials, one transposed as
    the Mosaic kernel writes it: equal to combine_splits + decode_outputs to float32 rounding and to the float64
    merge of the partials; empty splits (m = −inf, l = 0) and padding rows holding NaN (left unwritten by the
    kernels) change nothing; a cache flagged unusable gives NaN everywhere."""
    from lowbit_jax.thrift_reference import combine_splits, decode_outputs
    from pallas_kernels.thrift_combine import Partials, combine_decode
    from pallas_kernels.thrift_scalars import HEADER, USABLE

    rng = np.random.default_rng(tokens * 100 + group)
    b, hkv, rows = 2, 3, tokens * group

    def partials(splits):
        acc = rng.normal(size=(b, hkv, splits, r_pad, d))
        m = rng.normal(size=(b, hkv, splits, r_pad)) * 4
        l = rng.uniform(1.0, 3.0, size=(b, hkv, splits, r_pad))
        m[:, :, 1], l[:, :, 1], acc[:, :, 1] = -np.inf, 0.0, 0.0  # an empty split
        acc[..., rows:, :], m[..., rows:], l[..., rows:] = np.nan, np.nan, np.nan
        return acc, m, l

    groups64 = [partials(splits[0]), partials(splits[1])]
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    kernel_groups = (Partials(f32(np.swapaxes(groups64[0][0], -1, -2)), f32(groups64[0][1]), f32(groups64[0][2]),
                                transposed=True), Partials(*map(f32, groups64[1])))
    meta = np.full(r_pad + HEADER, -3, np.int32)  # positions and the unread header entries: garbage
    meta[r_pad + USABLE] = 1
    run = functools.partial(combine_decode, kernel_groups, rows=rows, tokens=tokens, num_heads=hkv * group,
                            out_dtype=jnp.float32, interpret=INTERPRET)
    got = np.asarray(run(jnp.asarray(meta)))
    assert got.shape == (b, tokens, hkv * group, d)
    real = lambda x: f32(x[..., :rows, :] if x.ndim == 5 else x[..., :rows])  # noqa: E731
    twin = decode_outputs(combine_splits(*[tuple(map(real, g)) for g in groups64]), tokens, hkv * group)
    np.testing.assert_allclose(got, np.asarray(twin), rtol=2e-6, atol=2e-6)
    acc = np.concatenate([g[0][..., :rows, :] for g in groups64], axis=2)
    m = np.concatenate([g[1][..., :rows] for g in groups64], axis=2)
    l = np.concatenate([g[2][..., :rows] for g in groups64], axis=2)
    w = np.exp2(m - m.max(axis=2, keepdims=True))
    o = (acc * w[..., None]).sum(axis=2) / (l * w).sum(axis=2)[..., None]  # (b, hkv, rows, d), rows g·T + t
    oracle = o.reshape(b, hkv, group, tokens, d).transpose(0, 3, 1, 2, 4).reshape(b, tokens, hkv * group, d)
    np.testing.assert_allclose(got, oracle, rtol=1e-5, atol=1e-5)
    meta[r_pad + USABLE] = 0
    assert np.isnan(np.asarray(run(jnp.asarray(meta)))).all()


def test_decode_kernel_refuses_unresolved_splits():
    from pallas_kernels.thrift_decode import thrift_decode as decode_kernel

    q, k, v = make_qkv(1, 64, 64, 4, 2, 64, seed=3)
    cache = filled_cache(k, v, 64)
    scalars = thrift_backends.decode_scalars(q[:, -1:], cache, budget=0.3, block=32, r_pad=16)
    args = thrift_backends.decode_kernel_args(q[:, -1:], cache, scalars, interpret=INTERPRET)
    with pytest.raises(ValueError, match="for_decode"):
        decode_kernel(*args, scale=0.125, config=lb.ThriftConfig(block=32, quant_block=32), row_tile=16,
                      interpret=INTERPRET)


def test_decode_default_splits_are_the_references():
    """With the split counts left to the call (several splits here: 16 key blocks, 4 a run), the kernel and the
    reference resolve the same ones: outputs equal to float rounding; a different split count is a different
    (FP4-rounding) result, so the test would see the two disagree."""
    q, k, v = make_qkv(1, 512, 512, 8, 2, 64, seed=31)
    cache = filled_cache(k, v, 512, max_len=512)
    cfg = lb.ThriftConfig(block=32, quant_block=32)
    resolved = cfg.for_decode(batch=1, kv_heads=2, head_rows=4, max_blocks=16, budget=0.25)
    assert resolved.decode_splits > 1
    run = functools.partial(lb.thrift_decode, q[:, -1:], cache, budget=0.25)
    got = run(config=cfg, implementation="pallas", interpret=INTERPRET)
    want = run(config=cfg, implementation="xla")
    other = run(config=dataclasses.replace(resolved, decode_splits=1), implementation="xla")
    assert metrics(got, want)[1] < 1e-5
    assert metrics(other, want)[1] > 1e-4


@pytest.mark.parametrize("t, hq", [(1, 8), (17, 8)])  # 4 of 16 rows; 68 rows in two 64-row tiles
def test_decode_kernel_leaves_padding_rows_unwritten(t, hq):
    """``rows=``: the kernel writes the real rows as it does without it, and none of the padding rows
    (outputs initialized to NaN by the interpreter or not at all on the GPU are never read back)."""
    from pallas_kernels.thrift_decode import thrift_decode as decode_kernel

    n, hkv, d = 90, 2, 64
    q, k, v = make_qkv(1, n + t, n + t, hq, hkv, d, seed=t)
    cache = filled_cache(k, v, n + t)
    qt = q[:, n:]
    rows = t * (hq // hkv)
    r_pad, row_tile = thrift_backends.decode_layout(rows)
    assert r_pad > rows
    scalars = thrift_backends.decode_scalars(qt, cache, budget=0.3, block=SMALL.block, r_pad=r_pad)
    args = thrift_backends.decode_kernel_args(qt, cache, scalars, interpret=INTERPRET)
    rows16 = decode_rows(qt.astype(jnp.float32), hkv, r_pad)  # zero padding rows (the order kernel leaves them)
    args = (rows16.astype(args[0].dtype), nvfp4.fake_quant_last(rows16).astype(jnp.float16), *args[2:])
    run = functools.partial(decode_kernel, *args, scale=d**-0.5, config=SMALL, row_tile=row_tile,
                            interpret=INTERPRET)
    full, skipped = run(), run(rows=rows)
    for a, b in zip(full, skipped):
        np.testing.assert_array_equal(np.asarray(a)[:, :, :, :rows], np.asarray(b)[:, :, :, :rows])
        assert not np.isnan(np.asarray(a)[:, :, :, rows:]).any()  # the full run writes its padding rows
    if INTERPRET:  # the interpreter fills unwritten outputs with NaN
        assert np.isnan(np.asarray(skipped[0])[:, :, :, rows:]).all()


# ----------------------------------------------------------------------------- the Mosaic GPU decode of the 4-bit runs

MOSAIC_DECODE_CASES = [  # (B, filled, T new, Hq, Hkv, D, budget, 4-bit splits)
    (1, 300, 1, 4, 2, 64, 0.25, 2),  # ragged: the last block partial; 2 rows of an 8-row tile
    (2, 390, 3, 8, 2, 128, 0.1, 4),  # 3 tokens × 4 heads: 12 of 16 rows; 6 blocks in runs of 2, 2, 2, 0
    (1, 128, 1, 2, 2, 64, 0.0, 4),  # MHA, whole blocks, every block 4-bit, runs of 1 and empty runs
    (1, 64, 2, 4, 1, 128, 1.0, 2),  # one block, all 16-bit: every 4-bit run empty
    (1, 1000, 16, 8, 2, 64, 0.05, 4),  # 64 rows: one 64-row tile
    (1, 200, 17, 8, 2, 64, 0.1, 2),  # 68 rows: two 64-row tiles, the second mostly padding
    (1, 500, 5, 8, 2, 128, 0.1, 2),  # 20 rows: a 32-row tile
]


def _mosaic_case(b, n, t, hq, hkv, d, seed):
    q, k, v = make_qkv(b, n + t, n + t, hq, hkv, d, seed=seed)
    cache = lb.ThriftKVCache.create(b, n + t + 40, hkv, d).append(k, v)  # max_len past the tokens: zeros after
    return q[:, n:], k, v, cache


@pytest.mark.parametrize("case, wgs", [(case, 1) for case in MOSAIC_DECODE_CASES] + [
    (MOSAIC_DECODE_CASES[1], 2), (MOSAIC_DECODE_CASES[1], 4), (MOSAIC_DECODE_CASES[2], 2),
    (MOSAIC_DECODE_CASES[3], 2), (MOSAIC_DECODE_CASES[5], 2), (MOSAIC_DECODE_CASES[0], 4)])
def test_decode_mosaic_partials_are_the_triton_kernels_4bit_runs(case, wgs):
    """The Mosaic kernel's (Oᵀ, m, l) of each 4-bit run equal the Triton kernel's first ``decode_splits`` splits
    (the same blocks, numerics and online softmax; the interpreter's products are exact in float32). With
    ``decode_compute_wgs`` = 2 or 4 the producer kernel: runs of 2, 2, 2, 0 blocks on one CTA's four compute
    warpgroups, empty runs, all 16-bit, two row tiles; 4 with two runs falls back to one warpgroup a CTA."""
    from pallas_kernels import thrift_decode, thrift_decode_mosaic

    b, n, t, hq, hkv, d, budget, splits = case
    qt, _, _, cache = _mosaic_case(b, n, t, hq, hkv, d, seed=n + d)
    cfg = lb.ThriftConfig(decode_splits=splits, decode_splits_high=2, decode_compute_wgs=wgs)
    assert thrift_decode_mosaic.producer_wgs(cfg, splits) == (wgs if splits % wgs == 0 else 1)
    rows = t * (hq // hkv)
    r_pad, row_tile = thrift_backends.decode_layout(rows)
    scalars = thrift_backends.decode_scalars(qt, cache, budget=budget, block=64, r_pad=r_pad)
    args = thrift_backends.decode_kernel_args(qt, cache, scalars, interpret=INTERPRET)
    acc, m, l = thrift_decode.thrift_decode(*args, scale=d**-0.5, config=cfg, row_tile=row_tile, interpret=INTERPRET)
    _, qf, _, _, _, k4, ks, v4, vs, order = args
    tile = thrift_backends.mosaic_row_tile(rows)
    acc_t, m2, l2 = thrift_decode_mosaic.thrift_decode_low(qf, scalars, order, k4, ks, v4, vs,
                                                           scale=d**-0.5, config=cfg, row_tile=tile, rows=rows,
                                                           interpret=INTERPRET)
    assert acc_t.shape == (b, hkv, splits, d, r_pad) and m2.shape == l2.shape == (b, hkv, splits, r_pad)
    want = [np.asarray(x[:, :, :splits, :rows], np.float64) for x in (acc, m, l)]
    got = [np.asarray(x, np.float64) for x in (jnp.swapaxes(acc_t, -1, -2)[..., :rows, :], m2[..., :rows],
                                               l2[..., :rows])]
    np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))  # the same empty runs (m = −inf, l = 0)
    for name, g, w in zip(("acc", "m", "l"), got, want):
        finite = np.isfinite(w)
        scale = max(np.abs(w[finite]).sum(), 1e-30)
        assert np.abs(g[finite] - w[finite]).sum() / scale < 1e-6, name


@pytest.mark.parametrize("case", MOSAIC_DECODE_CASES[:3])
def test_decode_mosaic_backend_matches_xla_and_exact(case):
    """The op with ``decode_backend="mosaic"`` (the Mosaic 4-bit runs, the Triton 16-bit runs, one combine)
    equals its XLA twin to float rounding and stays near exact attention (float64 oracle)."""
    b, n, t, hq, hkv, d, budget, splits = case
    qt, k, v, cache = _mosaic_case(b, n, t, hq, hkv, d, seed=n + d + 1)
    cfg = lb.ThriftConfig(decode_splits=splits, decode_splits_high=2, decode_backend="mosaic")
    got = lb.thrift_decode(qt, cache, budget=budget, config=cfg, implementation="pallas", interpret=INTERPRET)
    ref = lb.thrift_decode(qt, cache, budget=budget, config=cfg, implementation="xla")
    assert got.shape == (b, t, hq, d) and got.dtype == qt.dtype
    assert metrics(got, ref)[1] < 2e-3
    assert metrics(ref, exact_attention_f64(qt, k, v, causal=True))[0] > 0.975


@pytest.mark.parametrize("where", ["q", "k4", "v4"])
def test_decode_mosaic_shows_a_nonfinite_input(where):
    """NaN in a query, or inf in a key or value of a 4-bit block, gives a non-finite output wherever exact
    attention's is (the rows that see it), and finite outputs elsewhere."""
    b, n, t, hq, hkv, d = 1, 256, 1, 4, 2, 64
    q, k, v = make_qkv(b, n, n, hq, hkv, d, seed=5)
    qt = q[:, -1:]
    if where == "q":
        qt = qt.at[0, 0, 1, 3].set(jnp.nan)  # head 1: kv head 0's rows
    elif where == "k4":
        k = k.at[0, 10, 1, 7].set(jnp.inf)  # kv head 1, an old (4-bit at budget 0) block
    else:
        v = v.at[0, 10, 1, 7].set(jnp.inf)
    cache = lb.ThriftKVCache.create(b, n, hkv, d).append(k, v)
    cfg = lb.ThriftConfig(decode_splits=2, decode_splits_high=1, decode_backend="mosaic")
    got = np.asarray(lb.thrift_decode(qt, cache, budget=0.0, config=cfg, implementation="pallas",
                                      interpret=INTERPRET), np.float32)
    with np.errstate(invalid="ignore"):  # the oracle's own inf − inf
        exact = np.asarray(exact_attention_f64(qt, k, v, causal=True))
    bad_heads = ~np.isfinite(exact).all(axis=-1)
    assert bad_heads.any()
    np.testing.assert_array_equal(~np.isfinite(got).all(axis=-1), bad_heads)


def test_decode_backend_is_checked_and_falls_back_where_mosaic_does_not_cover():
    with pytest.raises(ValueError, match="decode_backend"):
        lb.ThriftConfig(decode_backend="cuda")
    for wgs in (3, 8, True):
        with pytest.raises(ValueError, match="decode_compute_wgs"):
            lb.ThriftConfig(decode_compute_wgs=wgs)
    cfg = lb.ThriftConfig(block=32, quant_block=32, decode_splits=2, decode_splits_high=2, decode_backend="mosaic")
    assert not thrift_backends.takes_mosaic_decode(cfg, head_dim=64, row_tile=16, interpret=True)  # block 32
    assert thrift_backends.takes_mosaic_decode(dataclasses.replace(cfg, block=64), head_dim=64, row_tile=16,
                                               interpret=True)
    assert not thrift_backends.takes_mosaic_decode(dataclasses.replace(cfg, block=64, decode_backend="auto"),
                                                   head_dim=64, row_tile=16, interpret=True)  # not compiled Hopper
    q, k, v = make_qkv(1, 100, 100, 4, 2, 64, seed=9)
    cache = filled_cache(k, v, 100)
    got = lb.thrift_decode(q[:, -1:], cache, budget=0.2, config=cfg, implementation="pallas", interpret=INTERPRET)
    ref = lb.thrift_decode(q[:, -1:], cache, budget=0.2, config=cfg, implementation="xla")
    assert metrics(got, ref)[1] < 2e-3

