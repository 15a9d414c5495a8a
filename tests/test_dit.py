"""Flux-style DiT: configs, RoPE, packing, schedule, and forward / sampling equal with and without
sequence parallelism on 8 fake CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_models import dit
from jax_cluster import parallel as sp

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def test_real_configs_have_the_real_sizes():
    flux = dit.get_config("flux")
    assert (flux.num_heads, flux.head_dim, flux.depth, flux.depth_single_blocks) == (24, 128, 19, 38)
    assert dit.param_count(flux) == 11_901_408_320  # Flux.1-dev
    cog = dit.get_config("cogvideox")
    assert (cog.num_heads, cog.head_dim) == (30, 64)
    assert 1.5e9 < dit.param_count(cog) < 2e9
    with pytest.raises(ValueError, match="sum\\(axes_dim\\)"):
        dit.get_config("tiny", axes_dim=(4, 4, 4))
    with pytest.raises(ValueError, match="unknown DiT config"):
        dit.get_config("sd3")


def test_rope_is_a_relative_rotation():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 2, 16)), jnp.float32)

    def rot(x, pos):
        cos, sin = dit.rope_angles(jnp.asarray([[pos]], jnp.float32), (4, 6, 6), 10000.0)
        return dit.apply_rope(x, cos, sin)

    d1 = jnp.sum(rot(q, (1, 5, 2)) * rot(k, (0, 3, 7)))
    d2 = jnp.sum(rot(q, (4, 9, 0)) * rot(k, (3, 7, 5)))  # same offsets
    np.testing.assert_allclose(d1, d2, rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(rot(q, (2, 3, 4))), jnp.linalg.norm(q), rtol=1e-6)
    # interleaved: channels (0, 1) form the first rotated pair, driven by axis 0 at full frequency
    x = jnp.zeros((1, 1, 1, 16)).at[..., 0].set(1.0)
    out = rot(x, (1, 0, 0))
    np.testing.assert_allclose(out[0, 0, 0, :2], [np.cos(1.0), np.sin(1.0)], rtol=1e-6)


def test_pack_unpack_and_schedule():
    x = jnp.arange(2 * 4 * 6 * 8, dtype=jnp.float32).reshape(2, 4, 6, 8)
    tokens = dit.pack(x)
    assert tokens.shape == (2, 12, 16)
    np.testing.assert_array_equal(dit.unpack(tokens, 6, 8), x)
    ts = dit.get_schedule(4, 4096)
    assert ts[0] == 1.0 and ts[-1] == 0.0 and all(a > b for a, b in zip(ts, ts[1:]))
    assert ts[2] > 0.5  # shifted towards high noise at high resolution


def test_adaln_zero_init_is_identity():
    cfg = dit.get_config("tiny", adaln_zero_init=True)
    model = dit.init_random(cfg)
    b, lt, h, w = 1, 4, 2, 2
    graph, state = nnx.split(model)
    args = (jnp.ones((b, h * w, cfg.in_channels)), dit.image_ids(b, h, w), jnp.ones((b, lt, cfg.context_in_dim)),
            dit.text_ids(b, lt), jnp.array([0.5]), jnp.ones((b, cfg.vec_in_dim)), jnp.array([3.0]))
    out = jax.jit(lambda s: nnx.merge(graph, s)(*args), compiler_options=FAST)(state)
    assert np.all(np.asarray(out) == 0)


def _inputs(cfg, b=2, lt=8, h=4, w=6, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return dict(img=f(b, h * w, cfg.in_channels), img_ids=dit.image_ids(b, h, w), txt=f(b, lt, cfg.context_in_dim),
                txt_ids=dit.text_ids(b, lt), timesteps=jnp.array([0.3, 0.8][:b]),
                y=f(b, cfg.vec_in_dim) if cfg.vec_in_dim else None,
                guidance=jnp.full((b,), 3.5) if cfg.guidance_embed else None)


@pytest.mark.parametrize("schedule,machines", [("torus", 2), ("usp", 4)])
def test_forward_equal_with_and_without_sequence_parallelism(schedule, machines):
    cfg = dit.get_config("tiny")  # 4 heads on 8 devices: P_u = 4, P_r = 2
    model = dit.init_random(cfg, seed=1)
    graph, state = nnx.split(model)
    args = _inputs(cfg)  # 8 text + 24 image tokens = 32, 4 per device

    def fwd(state, plan):
        return nnx.merge(graph, state)(**args, plan=plan)

    ref = jax.jit(lambda s: fwd(s, None), compiler_options=FAST)(state)
    plan = sp.plan(schedule, heads=cfg.num_heads, num_machines=machines)
    out = jax.jit(lambda s: fwd(s, plan), compiler_options=FAST)(state)
    assert out.shape == (2, 24, cfg.in_channels) and float(jnp.std(ref)) > 0.1
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-5)


def test_video_sampling_equal_with_and_without_sequence_parallelism():
    cfg = dit.get_config("tiny-video")  # 6 heads on 8 devices: P_u = 2 across machines, P_r = 4 within
    model = dit.init_random(cfg, seed=2)
    b, lt, t, h, w = 1, 8, 2, 2, 6  # 8 + 24 tokens
    rng = np.random.default_rng(3)
    img = jnp.asarray(rng.standard_normal((b, t * h * w, cfg.in_channels)), jnp.float32)
    txt = jnp.asarray(rng.standard_normal((b, lt, cfg.context_in_dim)), jnp.float32)
    ids, tids = dit.video_ids(b, t, h, w), dit.text_ids(b, lt)
    ts = dit.get_schedule(2, img.shape[1], shift=False)
    ref = dit.denoise(model, img, ids, txt, tids, ts, compiler_options=FAST)
    plan = sp.plan("tas", heads=cfg.num_heads, num_machines=2)
    assert (plan.ulysses_degree, plan.ring_degree) == (2, 4)
    out = dit.denoise(model, img, ids, txt, tids, ts, plan=plan, compiler_options=FAST)
    assert not np.allclose(np.asarray(ref), np.asarray(img))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-5)


def test_sample_image_latents():
    cfg = dit.get_config("tiny")
    model = dit.init_random(cfg)
    rng = np.random.default_rng(4)
    noise = jnp.asarray(rng.standard_normal((1, 4, 4, 4)), jnp.float32)
    txt = jnp.asarray(rng.standard_normal((1, 4, cfg.context_in_dim)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((1, cfg.vec_in_dim)), jnp.float32)
    out = dit.sample(model, noise, txt, y=y, guidance=3.5, num_steps=2)
    assert out.shape == noise.shape and np.all(np.isfinite(np.asarray(out)))
    with pytest.raises(ValueError, match="guidance"):
        model(dit.pack(noise), dit.image_ids(1, 2, 2), txt, dit.text_ids(1, 4), jnp.array([0.5]), y)
