"""Flax models: shapes per method, QK-norm, RoPE, KV-cache decode, bad configuration."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit_jax.dense
import models
from lowbit_jax.dense import _cudnn, cached_attention
from models.attention import Attention, rope


@pytest.mark.parametrize("method", ["dense", "sage", "qat_fp4", "thrift"])
def test_output_shapes(method):
    cfg = models.model_config("tiny", method=method)
    model = models.TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 40), 0, 256)
    logits = model(tokens)
    assert logits.shape == (2, 40, 256) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_sage_and_dense_models_agree_closely():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 64), 0, 256)
    outs = [models.TransformerLM(models.model_config("tiny", method=m, dtype="float32"), rngs=nnx.Rngs(0))(tokens)
            for m in ("dense", "sage")]
    a, b = (np.asarray(x).ravel() for x in outs)
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


def test_qat_model_is_fp4_quantized_but_close_to_dense():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 64), 0, 256)
    outs = [models.TransformerLM(models.model_config("tiny", method=m, dtype="float32"), rngs=nnx.Rngs(0))(tokens)
            for m in ("dense", "qat_fp4")]
    a, b = (np.asarray(x).ravel() for x in outs)
    cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert 0.9 < cos < 1.0 - 1e-6  # close (random init: FP4 error is large next to tiny logits), but really FP4


def test_qat_model_gradient_and_naive_option():
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 32), 0, 256)
    cfg = models.model_config("tiny", method="qat_fp4", dtype="float32")

    def grad_norm(options):
        model = models.TransformerLM(cfg, rngs=nnx.Rngs(0), attention_options=options)
        graphdef, params = nnx.split(model)
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)  # noqa: E731
        return jax.tree.leaves(jax.grad(loss)(params))

    qat, naive = grad_norm({}), grad_norm({"naive_backward": True})
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in qat)
    assert any(float(jnp.max(jnp.abs(a - b))) > 0 for a, b in zip(qat, naive))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_hot_embedding_equals_the_gather(dtype):
    """embed_tokens: the forward equals nnx.Embed's gather bit for bit; the table's gradient is the exact
    per-row sum of the cotangents, rounded once to the compute dtype (the gather's bf16 scatter-add rounds
    at every add, so there the one-hot gradient must be at least as close to the exact sum)."""
    from models.transformer import embed_tokens

    embed = nnx.Embed(256, 96, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.PRNGKey(4), (3, 200), 0, 256)  # every row index repeats
    cot = jax.random.normal(jax.random.PRNGKey(5), (3, 200, 96), jnp.float32).astype(dtype)
    np.testing.assert_array_equal(np.asarray(embed_tokens(embed, tokens), np.float32),
                                  np.asarray(embed(tokens), np.float32))
    graphdef, state = nnx.split(embed)

    def grad(lookup):
        def f(st):
            return jnp.sum(lookup(nnx.merge(graphdef, st)).astype(jnp.float32) * cot.astype(jnp.float32))

        return jax.tree.leaves(jax.grad(f)(state))[0]

    g_onehot, g_gather = grad(lambda e: embed_tokens(e, tokens)), grad(lambda e: e(tokens))
    exact = np.zeros((256, 96))
    np.add.at(exact, np.asarray(tokens).ravel(), np.asarray(cot, np.float64).reshape(-1, 96))
    assert np.abs(exact).max() > 1.0  # repeated indices really summed
    err = {name: np.abs(np.asarray(g, np.float64) - exact).max() for name, g in
           (("onehot", g_onehot), ("gather", g_gather))}
    tol = 2.0**-8 * np.abs(exact).max() if dtype == "bfloat16" else 1e-5
    assert err["onehot"] <= tol and err["onehot"] <= err["gather"] + 1e-6, err


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_gradient(dtype):
    """models.transformer.swiglu: forward = silu(gate)·up; its custom gradient equals autodiff of that formula
    in float32, and in bf16 it is the exact gradient rounded once (at least as close as autodiff's)."""
    from models.transformer import swiglu

    gu = (3 * jax.random.normal(jax.random.PRNGKey(8), (4, 33, 2 * 48), jnp.float32)).astype(dtype)
    dy = jax.random.normal(jax.random.PRNGKey(9), (4, 33, 48), jnp.float32).astype(dtype)

    def plain(x):
        g, u = jnp.split(x, 2, axis=-1)
        return jax.nn.silu(g) * u

    np.testing.assert_array_equal(np.asarray(swiglu(gu), np.float32), np.asarray(plain(gu), np.float32))
    ours = jax.vjp(swiglu, gu)[1](dy)[0]
    auto = jax.vjp(plain, gu)[1](dy)[0]
    assert ours.dtype == dtype and ours.shape == gu.shape
    g, u = np.split(np.asarray(gu, np.float64), 2, axis=-1)
    d = np.asarray(dy, np.float64)
    sig = 1 / (1 + np.exp(-g))
    exact = np.concatenate([d * u * sig * (1 + g * (1 - sig)), d * g * sig], axis=-1)
    err = lambda x: np.abs(np.asarray(x, np.float64) - exact)  # noqa: E731
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(ours), np.asarray(auto), rtol=1e-5, atol=1e-6)
        assert err(ours).max() <= 1e-5 * np.abs(exact).max()
    else:
        assert np.all(err(ours) <= 2.0**-8 * np.abs(exact) + 1e-6)
        assert err(ours).mean() <= err(auto).mean()


def test_qk_norm_normalizes_heads():
    attn = Attention(128, 2, 1, method="dense", rngs=nnx.Rngs(0), dtype=jnp.float32)
    x = 5.0 * jax.random.normal(jax.random.PRNGKey(2), (1, 16, 64))
    y = attn.q_norm(x)
    rms = np.sqrt(np.mean(np.asarray(y) ** 2, axis=-1))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-3)  # learnable scale starts at 1
    attn.q_norm.scale.set_value(2.0 * attn.q_norm.scale.get_value())
    np.testing.assert_allclose(np.sqrt(np.mean(np.asarray(attn.q_norm(x)) ** 2, axis=-1)), 2.0, rtol=1e-3)
    assert Attention(128, 2, 1, method="dense", qk_norm=False, rngs=nnx.Rngs(0)).q_norm is None


def test_rope_is_a_relative_rotation():
    q = jax.random.normal(jax.random.PRNGKey(3), (1, 1, 1, 64))
    k = jax.random.normal(jax.random.PRNGKey(4), (1, 1, 1, 64))
    dot = lambda i, j: float(jnp.sum(rope(q, jnp.array([i]), 1e4) * rope(k, jnp.array([j]), 1e4)))  # noqa: E731
    assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-4)
    np.testing.assert_allclose(np.linalg.norm(rope(q, jnp.array([7]), 1e4)), np.linalg.norm(q), rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_is_the_rotate_half_formula(dtype):
    """Bit for bit the textbook [x1·cos − x2·sin, x2·cos + x1·sin], batch-wise and per-token positions."""
    x = jax.random.normal(jax.random.PRNGKey(6), (2, 9, 3, 64), jnp.float32).astype(dtype)
    positions = jax.random.randint(jax.random.PRNGKey(7), (2, 9), 0, 500)

    @jax.jit
    def rotate_half(x, positions):
        angles = positions.astype(jnp.float32)[..., None] * 1e4 ** (-jnp.arange(0, 64, 2, dtype=jnp.float32) / 64)
        cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)

    want = rotate_half(x, positions)
    got = jax.jit(rope, static_argnums=2)(x, positions, 1e4)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("method", ["dense", "sage"])
def test_kv_cache_decode_matches_full_forward(method):
    cfg = models.model_config("tiny", method=method, dtype="float32")
    model = models.TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 24), 0, 256)
    full = models.TransformerLM(models.model_config("tiny", method="dense", dtype="float32"), rngs=nnx.Rngs(0))(
        tokens)
    cache = model.init_cache(2)
    logits_prefix, cache = model.decode(tokens[:, :16], cache)
    steps = [logits_prefix]
    for t in range(16, 24):
        logits, cache = model.decode(tokens[:, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=2e-4, rtol=2e-4)


def test_thrift_model_decodes_through_its_4bit_cache():
    """method="thrift": the cache is a ThriftKVCache. A 64-token prompt decoded in one call gives the logits of
    the full-sequence forward at budget 0 with one decode split (the same FP4 numerics row by row: whole V
    groups of 16 tokens); the tokens decoded one by one after it stay close to the full forward (there a V
    group was still partial when a token read it: prefill quantizes V with the later tokens of its group)
    and, at the default options, close to the dense model."""
    import lowbit_jax as lb

    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 80), 0, 256)
    cfg = models.model_config("tiny", method="thrift", dtype="float32")
    one_split = {"budget": 0.0, "config": lb.ThriftConfig(block=32, quant_block=32, decode_splits=1)}
    cos = lambda a, b: float(np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731

    def decoded(options):
        model = models.TransformerLM(cfg, rngs=nnx.Rngs(0), attention_options=options)
        cache = model.init_cache(2)
        assert isinstance(cache[0], lb.ThriftKVCache)
        assert cache[0].block == (options.get("config") or lb.ThriftConfig()).block
        prompt, cache = model.decode(tokens[:, :64], cache)
        graphdef, params = nnx.split(model)
        step = jax.jit(lambda p, c, tok: nnx.merge(graphdef, p).decode(tok, c))  # compiled once for every token
        steps = []
        for t in range(64, 80):
            logits, cache = step(params, cache, tokens[:, t:t + 1])
            steps.append(logits)
        assert int(cache[0].length) == 80
        return model, np.asarray(prompt), np.asarray(jnp.concatenate(steps, axis=1))

    model, prompt, steps = decoded(one_split)
    np.testing.assert_allclose(prompt, np.asarray(model(tokens[:, :64])), atol=2e-4, rtol=2e-4)
    assert cos(steps, np.asarray(model(tokens))[:, 64:]) > 0.995
    _, prompt, steps = decoded({})
    dense = models.TransformerLM(models.model_config("tiny", method="dense", dtype="float32"), rngs=nnx.Rngs(0))
    # random init: FP4 error is large next to tiny logits (as for qat_fp4 above); 80 tokens hold one complete
    # 64-token block, whose budget share rounds to 0: all 4-bit here
    assert cos(np.concatenate([prompt, steps], axis=1), np.asarray(dense(tokens))) > 0.9


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(method="flash"), "attention method must be one of"),
        (dict(num_heads=3), "num_heads"),
        (dict(num_kv_heads=3, num_heads=4, dim=256), "num_heads"),
        (dict(dim=96, num_heads=2), "head dim"),
        (dict(remat="full"), "remat must be one of"),
    ],
)
def test_bad_model_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        models.model_config("tiny", **overrides)


def test_unknown_preset_and_too_long_sequence():
    with pytest.raises(ValueError, match="unknown model preset"):
        models.model_config("huge")
    model = models.TransformerLM(models.model_config("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="exceeds the model's max_len"):
        model(jnp.zeros((1, 300), jnp.int32))


@pytest.mark.parametrize("method, options", [
    ("sage", {"implementation": "pallas", "interpret": True}),  # the kernels' custom_vjp inside nnx.remat
    ("qat_fp4", {}),  # the xla implementation's custom_vjp (dense and sage xla remat the same way)
])
def test_remat_recomputes_without_changing_gradients(method, options):
    """ModelConfig.remat ("block", "dots"): the backward recomputes the blocks (a `remat` equation in the
    gradient's jaxpr, none without remat) and the parameter gradients equal those with every residual
    stored, the attention custom_vjp's INT8/FP4 residuals included."""
    tokens = jax.random.randint(jax.random.PRNGKey(7), (2, 48), 0, 256)

    def grads(remat):
        cfg = models.model_config("tiny", method=method, dtype="float32", remat=remat)
        graphdef, params = nnx.split(models.TransformerLM(cfg, rngs=nnx.Rngs(0), attention_options=options))
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)  # noqa: E731
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
        return jax.tree.leaves(jax.jit(jax.grad(loss))(params)), "remat" in jaxpr  # jax.checkpoint's primitive

    want, has_checkpoint = grads("none")
    assert not has_checkpoint
    for remat in ("block", "dots"):
        got, has_checkpoint = grads(remat)
        assert has_checkpoint, remat
        for g, w in zip(got, want):
            assert bool(jnp.all(jnp.isfinite(g)))
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(w))))


def _cache_inputs(t, start):
    """q (2, T, 4, 32) and a (2, 64, 2, 32) k, v cache, float32, whose slots past ``start + T`` are garbage."""
    ks = jax.random.split(jax.random.PRNGKey(start + t), 3)
    q = jax.random.normal(ks[0], (2, t, 4, 32), jnp.float32)
    kc = jax.random.normal(ks[1], (2, 64, 2, 32), jnp.float32) * 3.0
    vc = jax.random.normal(ks[2], (2, 64, 2, 32), jnp.float32)
    return q, kc, vc


def _assert_sees_the_filled_keys(got, q, kc, vc, start):
    """Token i of the T new ones (at ``start + i``) equals attention over the cached keys 0 … start + i alone."""
    for i in range(q.shape[1]):
        n = start + i + 1
        want = jax.nn.dot_product_attention(q[:, i:i + 1], kc[:, :n], vc[:, :n])
        np.testing.assert_allclose(np.asarray(got[:, i:i + 1]), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("t, start, chunk", [(1, 0, None), (1, 37, None), (3, 20, None), (5, 20, 2), (4, 0, 1)])
def test_cached_attention_sees_the_filled_keys_up_to_each_token(t, start, chunk, monkeypatch):
    """lowbit_jax.dense.cached_attention (the 16-bit decode of every method but thrift): token i of T new ones
    at ``start + i`` attends to the cached keys 0 … start + i and to nothing after them (the cache's tail holds
    garbage here, which must not leak in), also when the tokens go through in chunks (``chunk`` new tokens per
    masked call: 5 tokens as 2 + 2 + 1 padded to 2); on the CPU it is the XLA path (cuDNN needs a GPU)."""
    if chunk is not None:  # a score budget of `chunk` rows of (batch 2 × 4 heads × 64 slots)
        monkeypatch.setattr(lowbit_jax.dense, "MASKED_SCORES_PER_CHUNK", chunk * 2 * 4 * 64)
    q, kc, vc = _cache_inputs(t, start)
    assert not _cudnn(q.astype(jnp.bfloat16))
    got = cached_attention(q, kc, vc, jnp.int32(start))
    _assert_sees_the_filled_keys(got, q, kc, vc, start)


def _xla_with_lse(q, k, v, *, causal, kv_lengths=None):
    """XLA stand-in for lowbit_jax.dense._cudnn_with_lse: the same masks (top-left causal, key padding), the
    output and the float32 log-sum-exp (B, T, Hq) of the scaled scores."""
    b, t, h, d = q.shape
    group = h // k.shape[2]
    kk, vv = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, kk).astype(jnp.float32) * d ** -0.5
    keep = jnp.ones((b, 1, t, k.shape[1]), bool)
    if causal:
        keep &= jnp.tril(jnp.ones((t, k.shape[1]), bool))
    if kv_lengths is not None:
        keep &= (jnp.arange(k.shape[1]) < kv_lengths[:, None])[:, None, None, :]
    s = jnp.where(keep, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", jnp.exp(s - lse[..., None]), vv.astype(jnp.float32))
    return o.astype(q.dtype), jnp.swapaxes(lse, 1, 2)


@pytest.mark.parametrize("t, start", [(1, 37), (6, 0), (6, 20), (5, 59), (40, 24), (40, 0)])
def test_cached_attention_cudnn_route_sees_the_filled_keys_up_to_each_token(t, start, monkeypatch):
    """The cuDNN route's logic, with cuDNN emulated by XLA's attention (the same arguments: filled lengths, the
    top-left causal flag, key padding): one token over the filled length; several as the cached part (padded keys)
    and the new part (top-left causal over themselves) merged by their log-sum-exps, up to the cache's last slot
    (5 after 59 of 64 slots), for more new tokens than cached ones (40 after 24), and into an empty cache, where
    the output must be exactly the causal part's. The garbage in the cache's tail must not leak in. The real cuDNN
    is checked on the GPU (benchmarks/serving.py --prefill)."""
    dpa = jax.nn.dot_product_attention
    calls = []

    def emulated(*args, implementation=None, **kwargs):
        assert implementation == "cudnn"
        calls.append(sorted(k for k, v in kwargs.items() if v is not None and v is not False))
        return dpa(*args, **kwargs)

    def emulated_lse(q, k, v, *, causal, kv_lengths=None):
        calls.append(["lse", causal, kv_lengths is not None, k.shape[1]])
        return _xla_with_lse(q, k, v, causal=causal, kv_lengths=kv_lengths)

    monkeypatch.setattr(lowbit_jax.dense, "_cudnn", lambda q: True)
    monkeypatch.setattr(lowbit_jax.dense.jax.nn, "dot_product_attention", emulated)
    monkeypatch.setattr(lowbit_jax.dense, "_cudnn_with_lse", emulated_lse)
    q, kc, vc = _cache_inputs(t, start)
    got = jax.jit(functools.partial(cached_attention, implementation="cudnn"))(q, kc, vc, jnp.int32(start))
    monkeypatch.undo()
    _assert_sees_the_filled_keys(got, q, kc, vc, start)
    if start == 0:
        causal = jax.jit(lambda q, k, v: _xla_with_lse(q, k, v, causal=True)[0])(q, kc[:, :t], vc[:, :t])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(causal))
    kinds = {tuple(c) for c in calls}
    assert kinds == ({("key_value_seq_lengths",)} if t == 1 else {("lse", False, True, 64), ("lse", True, False, t)})


def test_the_private_cudnn_wrapper_cached_attention_uses_is_there():
    """lowbit_jax.dense._cudnn_with_lse calls jax._src.cudnn.fused_attention_stablehlo.dot_product_attention (the
    public jax.nn API rounds the log-sum-exp it returns to bf16): a JAX upgrade that moves or changes it fails
    here, on the CPU, instead of on the first GPU decode."""
    import inspect

    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    params = inspect.signature(cudnn.dot_product_attention).parameters
    assert {"q_seqlen", "kv_seqlen", "scale", "mask_type", "return_residual"} <= set(params)
    assert {"NO_MASK", "CAUSAL", "PADDING", "PADDING_CAUSAL"} <= set(cudnn.MaskType.__members__)


def test_cached_attention_rejects_bad_implementation():
    q = jnp.ones((1, 2, 4, 32), jnp.bfloat16)
    kc = jnp.ones((1, 8, 2, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation must be one of"):
        cached_attention(q, kc, kc, jnp.int32(0), implementation="triton")
    with pytest.raises(ValueError, match="needs a GPU"):
        cached_attention(q, kc, kc, jnp.int32(0), implementation="cudnn")
    with pytest.raises(ValueError, match="more than the cache"):
        cached_attention(jnp.ones((1, 9, 4, 32), jnp.bfloat16), kc, kc, jnp.int32(0))


def test_thrift_model_decodes_a_long_chunk_after_cached_tokens_in_decode_calls():
    """A thrift model's decode of more tokens after cached ones than one thrift_decode call takes
    (MAX_DECODE_ROWS query rows: 700 tokens × a group of 2 heads) runs them in chunks: the same logits and cache
    as two decode calls of 512 and 188 tokens (one call of 700 raises in thrift_decode itself)."""
    import lowbit_jax as lb
    from lowbit_jax.thrift import MAX_DECODE_ROWS

    cfg = models.model_config("tiny", method="thrift", max_len=1024)
    group = cfg.num_heads // cfg.num_kv_heads
    assert 700 * group > MAX_DECODE_ROWS and 512 * group == MAX_DECODE_ROWS
    model = models.TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(9), (1, 730), 0, 256)
    decode = jax.jit(model.decode)
    _, cached = decode(tokens[:, :30], model.init_cache(1))  # a prompt (the prefill) first
    got, cache = decode(tokens[:, 30:], cached)
    first, part = decode(tokens[:, 30:542], cached)
    second, part = decode(tokens[:, 542:], part)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.concatenate([first, second], axis=1)))
    assert int(cache[0].length) == int(part[0].length) == 730
    np.testing.assert_array_equal(np.asarray(cache[-1].k4), np.asarray(part[-1].k4))
    assert np.isfinite(np.asarray(got)).all()
    with pytest.raises(ValueError, match="at most"):
        q = jnp.ones((1, 700, cfg.num_heads, cfg.dim // cfg.num_heads), jnp.bfloat16)
        lb.thrift_decode(q, lb.ThriftKVCache.create(1, 1024, cfg.num_kv_heads, cfg.dim // cfg.num_heads).append(
            q[:, :, :cfg.num_kv_heads], q[:, :, :cfg.num_kv_heads]))


def _assert_same_but_rounding(got, want) -> None:
    """Equal values, but for XLA compiling one of the two programs differently: a matmul over 90 tokens and one
    over 1 token, or two fusions, may round a bf16 value to its other neighbour (seen on the CPU: one element of
    16384, one ulp apart). So at most 0.1% of the elements differ, floats by at most one bf16 ulp (a 4-bit code
    or scale of such a value may then differ too); a real difference (another selection, position or token)
    changes far more."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    differ = g != w
    assert differ.mean() < 1e-3, (differ.sum(), differ.size)
    if jnp.issubdtype(jnp.asarray(want).dtype, jnp.floating):
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w), 2.0**-100))) - 7)  # bf16 spacing at each value
        assert (np.abs(g - w) <= ulp).all(), np.abs(g - w).max()


@pytest.mark.parametrize("t", [2, 90])
def test_thrift_model_prefills_a_prompt_as_its_forward_pass(t):
    """A prompt into a thrift model's empty caches is ThriftAttention's prefill: the forward pass's logits (its
    attention is thrift_attention over the sequence), not per-token decodes (whose selection differs), and the
    caches hold the prompt as appending it token by token would; the next token then decodes from them."""
    cfg = models.model_config("tiny", method="thrift", max_len=128)
    model = models.TransformerLM(cfg, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.PRNGKey(t), (2, t + 1), 0, 256)
    logits, caches = jax.jit(model.decode)(tokens[:, :t], model.init_cache(2))
    want = jax.jit(lambda x: model(x))(tokens[:, :t])
    _assert_same_but_rounding(logits, want)
    # per-token decodes are another computation (the decode's own selection and 4-bit reads): not these logits
    stepwise, c = [], model.init_cache(2)
    for i in range(t):
        y, c = model.decode(tokens[:, i:i + 1], c)
        stepwise.append(y)
    assert not np.allclose(np.asarray(jnp.concatenate(stepwise, 1), np.float32), np.asarray(want, np.float32),
                           atol=1e-3)
    assert [int(x.length) for x in caches] == [int(x.length) for x in c] == [t] * cfg.num_layers
    # the first layer's K/V depend on the tokens alone: the prompt's cache equals t appends of one token
    for a, b in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(c[0])):
        _assert_same_but_rounding(a, b)
    nxt, after = jax.jit(model.decode)(tokens[:, t:], caches)
    assert nxt.shape == (2, 1, cfg.vocab_size) and int(after[0].length) == t + 1


@pytest.mark.parametrize("method", ["dense", "sage", "qat_fp4", "thrift"])
def test_prefill_is_decode_from_empty_caches(method):
    """TransformerLM.prefill (the static empty-cache route) gives decode-from-init_cache's logits and caches for
    every method, and the next decode step continues from its caches; too long a prompt is refused."""
    cfg = models.model_config("tiny", method=method, max_len=96)
    model = models.TransformerLM(cfg, rngs=nnx.Rngs(5))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 71), 0, 256)
    got, caches = jax.jit(model.prefill)(tokens[:, :70])
    want, ref = jax.jit(model.decode)(tokens[:, :70], model.init_cache(2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(caches), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    nxt, _ = jax.jit(model.decode)(tokens[:, 70:], caches)
    nxt_ref, _ = jax.jit(model.decode)(tokens[:, 70:], ref)
    np.testing.assert_array_equal(np.asarray(nxt), np.asarray(nxt_ref))
    with pytest.raises(ValueError, match="exceeds the model's max_len"):
        model.prefill(jnp.zeros((1, 97), jnp.int32))
    attn = Attention(128, 4, 2, method=method, causal=False, rngs=nnx.Rngs(0))
    for fn in (attn.prefill, attn.decode):
        with pytest.raises(ValueError, match="causal=False"):
            fn(jnp.ones((1, 3, 128), jnp.bfloat16), attn.init_cache(1, 64))


def test_cached_attention_of_a_long_prompt_holds_a_bounded_score_tensor():
    """A 2048-token prompt over an 8192-slot cache at B4 with 10 heads (XLA path): one masked call would hold
    B·H·T·S float32 scores (2.5 GiB and more); in chunks the compiled temporaries stay under 1 GiB."""
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    args = (sd(4, 2048, 10, 64), sd(4, 8192, 5, 64), sd(4, 8192, 5, 64), jax.ShapeDtypeStruct((), jnp.int32))
    temp = lambda fn: jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
    chunked, whole = temp(cached_attention), temp(lowbit_jax.dense._masked_attention)
    assert whole > 4 * 2**30 * 0.6 and chunked < 2**30


def test_serving_benchmark_decodes_filled_caches_as_the_model_does():
    """benchmarks/serving.py's filled caches are the model's own cache structure (they once lacked a key the
    16-bit append reads), and every method decodes from the same cached keys: thrift with every block in
    16-bit (f = 1) picks dense's greedy tokens."""
    from benchmarks import serving

    model = models.TransformerLM(models.model_config("tiny", method="dense", max_len=256), rngs=nnx.Rngs(0))
    empty, filled = model.init_cache(2), serving.filled_caches(model, 2, 100)
    assert jax.tree.structure(filled) == jax.tree.structure(empty)
    assert all(int(c["length"]) == 100 for c in filled)
    row = serving.run("tiny", 2, 100, steps=1, rounds=1, budgets=(1.0,),
                      impl=dict(implementation="pallas", interpret=True), log=lambda *_: None)
    assert row["first_tokens"]["thrift f=1"] == row["first_tokens"]["dense"]
