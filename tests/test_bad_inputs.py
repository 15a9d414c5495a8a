"""Bad input gets a ValueError or TypeError before anything runs, for every decode op: each
array argument of a valid call is mutated in turn (wrong dtype, a dimension dropped or
added, one axis a size too long or too short) and the call must refuse it, unless the
mutation leaves a call that is still valid (listed in STILL_VALID, and then it must run).
The ops' own tests check the messages; this checks that no mutation slips past them into
a custom call, where it would crash the process or compute garbage."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster as jc

B, HKV, G, DH, S = 3, 2, 2, 64, 40
HQ, D, F = HKV * G, 128, 128
H, R, DR, DN, DV = 4, 32, 16, 16, 16  # mla_decode
E, I = 8, 32  # moe_decode


@functools.cache
def _calls():
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16

    def a(*shape, dtype=dt):
        return jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32).astype(dtype)

    def freqs(n):
        return jnp.asarray(10000.0 ** (-np.arange(0, n, 2) / n), jnp.float32)

    lengths = jnp.asarray([0, 5, S - 1], jnp.int32)
    caches = dict(k_cache=a(B, HKV, S, DH), v_cache=a(B, HKV, S, DH))
    qkv_cols = (HQ + 2 * HKV) * DH
    layer = dict(norm=a(D), qkv=a(D, qkv_cols), o=a(HQ * DH, D), post_norm=a(D), w_gate=a(D, F), w_up=a(D, F),
                 w_down=a(F, D))
    mla = dict(norm=a(D), q=a(D, H * (DN + DR)), kv_a=a(D, R + DR), kv_a_norm=a(R), kv_b=a(R, H * (DN + DV)),
               o=a(H * DV, D))
    return {
        "decode_attention": (jc.decode_attention, dict(q=a(B, HKV, G, DH), **caches, lengths=lengths), {}),
        "decode_attention_append": (
            jc.decode_attention_append,
            dict(qkv=a(B, qkv_cols, dtype=jnp.float32), **caches, lengths=lengths, inv_freq=freqs(DH)),
            dict(num_q_heads=HQ, scale=DH ** -0.5)),
        "attention_block": (
            jc.attention_block,
            dict(x=a(B, D), w_qkv=a(D, qkv_cols), w_o=a(HQ * DH, D), **caches, lengths=lengths, inv_freq=freqs(DH),
                 norm_weight=a(D)),
            dict(num_q_heads=HQ, num_kv_heads=HKV)),
        "swiglu": (jc.swiglu, dict(x=a(B, D), w_gate=a(D, F), w_up=a(D, F), w_down=a(F, D), residual=a(B, D)), {}),
        "linear": (jc.linear, dict(a=a(B, D), w=a(D, F), residual=a(B, F)), {}),
        "decoder_layer": (
            jc.decoder_layer, dict(x=a(B, D), weights=layer, **caches, lengths=lengths, inv_freq=freqs(DH)),
            dict(family="llama", num_q_heads=HQ, num_kv_heads=HKV, eps=1e-6)),
        "mla_decode": (
            jc.mla_decode, dict(x=a(B, D), weights=mla, latent_cache=a(B, S, R + DR), lengths=lengths,
                                inv_freq=freqs(DR)),
            dict(num_heads=H, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV, scale=0.1,
                 eps=1e-6)),
        "moe_decode": (
            jc.moe_decode, dict(x=a(B, D), router=a(D, E, dtype=jnp.float32), w_gate=a(E, D, I), w_up=a(E, D, I),
                                w_down=a(E, I, D)),
            dict(top_k=2)),
    }


# Mutations that leave a valid call: another GQA group size, a larger cache capacity, another
# number of MoE rows, a float16 router (any float dtype routes in fp32), int32 lengths (no
# change).
STILL_VALID = {("decode_attention", "q", "ax2+1"), ("decode_attention", "q", "ax2-1"),
               ("mla_decode", "latent_cache", "ax1+1"),
               ("moe_decode", "x", "ax0+1"), ("moe_decode", "x", "ax0-1"), ("moe_decode", "router", "float16")}


def _mutations(v):
    yield "int32", v.astype(jnp.int32)
    yield ("float16", v.astype(jnp.float16)) if v.dtype == jnp.float32 else ("float32", v.astype(jnp.float32))
    yield "drop_dim", v[..., 0] if v.ndim > 1 else v[0]
    yield "add_dim", v[None]
    for ax in range(v.ndim):
        for step in (1, -1):
            shape = list(v.shape)
            shape[ax] += step
            if shape[ax] > 0:
                yield f"ax{ax}{step:+d}", jnp.zeros(shape, v.dtype)


def _cases():
    for op, (_, args, _) in _calls().items():
        for name, value in args.items():
            for key, v in (value.items() if isinstance(value, dict) else [(None, value)]):
                for mutation, _ in _mutations(v):
                    yield op, name, key, mutation


CASES = list(_cases())


@pytest.mark.parametrize("op,name,key,mutation", CASES,
                         ids=[f"{o}-{n}{'.' + k if k else ''}-{m}" for o, n, k, m in CASES])
def test_mutated_argument_is_refused(op, name, key, mutation):
    fn, args, kw = _calls()[op]
    args = dict(args)  # the cached call stays valid for the next case
    value = args[name] if key is None else args[name][key]
    bad = dict(_mutations(value))[mutation]
    if key is None:
        args[name] = bad
    else:
        args[name] = dict(args[name], **{key: bad})
    if (op, key or name, mutation) in STILL_VALID or (name == "lengths" and mutation == "int32"):
        jax.block_until_ready(fn(**args, **kw, impl="cuda"))
        return
    with pytest.raises((ValueError, TypeError)):
        jax.block_until_ready(fn(**args, **kw, impl="cuda"))
