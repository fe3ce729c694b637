"""Temporary: why does the xla SageBwd reference give a wrong dV on the GPU? Compare GPU vs CPU pieces."""
import functools, json, os
import jax, jax.numpy as jnp, numpy as np
import lowbit_jax as lb
from lowbit_jax import sage as sm
from lowbit_jax.formats import int8
from lowbit_jax.sage_reference import sage_backward_reference, to_tiles, _int8_product

cpu = jax.devices("cpu")[0]
gpu = jax.devices()[0]
b, sq, sk, hq, hkv, d, causal = 2, 100, 77, 4, 2, 64, True
ks = jax.random.split(jax.random.PRNGKey(sq * sk), 4)
q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.bfloat16)
k = (jax.random.normal(ks[1], (b, sk, hkv, d)) + 2.0).astype(jnp.bfloat16)
v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.bfloat16)
do = jax.random.normal(ks[3], q.shape, q.dtype)
opts = sm.resolve_options(q, k, v, causal=causal, implementation="xla")
out = {}
def on(dev, f, *args):
    args = jax.device_put(args, dev)
    with jax.default_device(dev):
        return jax.device_get(jax.jit(f)(*args))
o, lse, ops = sm._forward(q, k, v, opts=opts, transposed=False)
ops, o, lse = jax.device_get((ops, o, lse))
full = lambda ops, o, lse, do: sage_backward_reference(ops, None, o, lse, do, sq_len=sq, sk_len=sk, causal=causal, per_block=True, scale=opts.scale, config=opts.config, intermediates=True)
(gg, ig), (gc, ic) = on(gpu, full, ops, o, lse, do), on(cpu, full, ops, o, lse, do)
for n, a, c in zip(("dq","dk","dv"), gg, gc):
    out[n] = float(lb.rel_l1(a, c)); print(n, "gpu vs cpu rel-L1", out[n])
for n in ig:
    out["int_"+n] = float(lb.rel_l1(ig[n], ic[n])); print(n, out["int_"+n])
# pieces of the dV path
bq = opts.config.bwd_block_q
p = ic["P"]  # (B,H,Sq,Sk) from cpu
pp = jnp.pad(jnp.asarray(p), ((0,0),(0,0),(0,0),(0, 128 - sk)))[:, :, :bq].reshape(b, hq, bq, -1, opts.config.bwd_block_k)
def qu(pt): return int8.quantize_unit(pt, 2)
(g8, gs), (c8, cs) = on(gpu, qu, pp), on(cpu, qu, pp)
out["p8_mismatch"] = int(np.sum(np.asarray(g8) != np.asarray(c8))); out["pscale"] = float(lb.rel_l1(gs, cs))
print("quantize_unit p8 mismatches", out["p8_mismatch"], "scale rel", out["pscale"])
print("gpu codes", np.asarray(g8)[0, 0, :4, 0, :6].tolist(), "cpu codes", np.asarray(c8)[0, 0, :4, 0, :6].tolist())
print("gpu pad codes", np.asarray(g8)[0, 0, :2, 1, -4:].tolist(), "cpu", np.asarray(c8)[0, 0, :2, 1, -4:].tolist())
from lowbit_jax.formats.int8 import MAGIC, MAGIC_BITS, QMAX
def bitform(e):
    return (jax.lax.bitcast_convert_type(e * QMAX + MAGIC, jnp.int32) - MAGIC_BITS).astype(jnp.int8)
e = jnp.linspace(0, 1, 1000, dtype=jnp.float32)
print("bit form gpu==cpu", bool(np.all(on(gpu, bitform, e) == on(cpu, bitform, e))))
do_p, _ = to_tiles(jnp.asarray(do, jnp.float32), bq)
def dq8(x): return int8.quantize(x, (-2, -1))
(gd, gds), (cd, cds) = on(gpu, dq8, do_p), on(cpu, dq8, do_p)
out["do8_mismatch"] = int(np.sum(np.asarray(gd) != np.asarray(cd)))
print("do8 mismatches", out["do8_mismatch"])
prod = lambda a, bb: _int8_product("bhqjk,bhqd->bhjkd", a, bb)
x1, x2 = on(gpu, prod, c8, cd[:, :, 0]), on(cpu, prod, c8, cd[:, :, 0])
out["prod"] = float(lb.rel_l1(x1, x2)); print("int8 product gpu vs cpu", out["prod"])
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/debug_dv.json", "w"), indent=1)
