"""DeepSeek-V2 conformance against transformers (CPU, fp32), and the YaRN softmax scale.

The installed transformers (checked at run time below) multiplies DeepSeek-V2's softmax scale by
mscale(factor, mscale_all_dim)^2 (the fix of PR #47435); older versions did not. When it does not,
the conformance test sets transformers' per-layer scale to the reference formula, so the rest of
the model is still compared, and the formula itself is tested against hand-computed numbers.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax_models.deepseek_v2 as ds  # noqa: E402
import flax_models.mla as mla  # noqa: E402
from flax_models import ops  # noqa: E402
from flax_models.config import DeepseekV2Config, RopeConfig  # noqa: E402
from flax_models.loading import from_pretrained  # noqa: E402
from flax_models.testing import compare_greedy, compare_logits, hf_roundtrip  # noqa: E402

TOL = 1e-4
BASE = dict(vocab_size=96, initializer_range=0.2, max_position_embeddings=256)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
YARN_AF = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
           "mscale": 1.0, "mscale_all_dim": 0.5}  # cos/sin factor mscale/mscale_all_dim != 1

CONFIGS = {
    "qlora-moe4-top2-yarn": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                                 num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                 qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                 n_shared_experts=1, first_k_dense_replace=1, rope_parameters=YARN),
    "noqlora-moe8-top3-shared2": dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=24,
                                      num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=32, q_lora_rank=None,
                                      qk_nope_head_dim=16, qk_rope_head_dim=4, v_head_dim=16, n_routed_experts=8,
                                      num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=0,
                                      tie_word_embeddings=True),
    "group-limited-bias-yarn-af": dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                                       num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=8, q_lora_rank=12,
                                       qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8,
                                       num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                       topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                       routed_scaling_factor=2.0, attention_bias=True, rope_parameters=YARN_AF),
    "dense-only-noqlora": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
                               v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                               first_k_dense_replace=2),
}


def hf_has_mscale(hf_model, cfg) -> bool:
    plain = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    return abs(hf_model.model.layers[0].self_attn.scaling - plain) > 1e-12


def _align_hf_scale(hf, ours_cfg):
    """Older transformers omit the YaRN mscale: give them the reference scale so the rest is compared."""
    for layer in hf.model.layers:
        layer.self_attn.scaling = mla.softmax_scale(ours_cfg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deepseek_v2_matches_transformers(name, tmp_path):
    cfg = transformers.DeepseekV2Config(**BASE, **CONFIGS[name])
    hf, model = hf_roundtrip(cfg, tmp_path)
    if not hf_has_mscale(hf, cfg):
        _align_hf_scale(hf, model.config)
    err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=16)
    assert err["prefill"] <= TOL, err
    assert err["decode"] <= TOL, err
    ours, theirs = compare_greedy(hf, model)
    assert ours == theirs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deepseek_v2_fused_mla_on_cpu_matches_transformers(name, tmp_path):
    """Decode through jax_cluster.mla_decode's C++ CPU handler (impl attention=fused)."""
    if not ops.fused_available("mla_decode"):
        pytest.skip("jax_cluster.mla_decode not available")
    cfg = transformers.DeepseekV2Config(**BASE, **CONFIGS[name])
    hf, model = hf_roundtrip(cfg, tmp_path, impl="attention=fused,mlp=xla")
    if not hf_has_mscale(hf, cfg):
        _align_hf_scale(hf, model.config)
    with ops.record_routes() as routes:
        err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=8)
    assert err["decode"] <= TOL, err
    assert "mla_decode: jax_cluster (C++ CPU handler, no GPU)" in [str(r) for r in routes]


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if "dense-only" not in n))
def test_deepseek_v2_fused_moe_on_cpu_matches_transformers(name, tmp_path, monkeypatch):
    """fp32 decode with MLA and the MoE (routed and shared experts) through jax_cluster's C++ CPU
    handlers (mla_decode, moe_decode: both take float32 on CPU), at the fp32 tolerance.

    The dense layers' SwiGLU stays on XLA here: jax_cluster.swiglu has no float32 path (CPU
    handler included) and needs widths that are multiples of 64, which these configs' are not.
    The bf16 test below runs every block fused."""
    if not (ops.fused_available("mla_decode") and ops.fused_available("moe_decode")):
        pytest.skip("jax_cluster.mla_decode / moe_decode not available")
    cfg = transformers.DeepseekV2Config(**BASE, **CONFIGS[name])
    hf, model = hf_roundtrip(cfg, tmp_path, impl="fused")
    if not hf_has_mscale(hf, cfg):
        _align_hf_scale(hf, model.config)
    routes = _fp32_fused_decode_matches(hf, model, monkeypatch)
    assert "mla_decode: jax_cluster (C++ CPU handler, no GPU)" in routes, routes


def _fp32_fused_decode_matches(hf, model, monkeypatch) -> list[str]:
    """8 fused fp32 decode steps within TOL of transformers, the dense SwiGLU on XLA (swiglu has no
    float32 path) and the MoE on the CPU handler; returns the routes."""
    swiglu_mlp = ops.swiglu_mlp
    monkeypatch.setattr(ops, "swiglu_mlp", lambda *a, impl, **k: swiglu_mlp(*a, impl="xla", **k))
    with ops.record_routes() as routes:
        err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=8)
    assert err["decode"] <= TOL, err
    routes = [str(r) for r in routes]
    assert "moe: jax_cluster (C++ CPU handler, no GPU)" in routes, routes
    return routes


# H, the dense and the shared SwiGLU widths multiples of 64: every decode block has a fused op.
FUSABLE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
               v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
               first_k_dense_replace=1, rope_parameters=YARN)


def test_deepseek_v2_all_fused_bf16_on_cpu_matches_transformers(tmp_path):
    """bf16 decode with every block fused (mla_decode, swiglu, moe_decode with its shared experts
    through swiglu; C++ CPU handlers) against transformers in fp32: as close as our XLA bf16
    decode is (bf16 rounding dominates both; a wrong op would be far off)."""
    if not all(ops.fused_available(op) for op in ("mla_decode", "moe_decode", "swiglu")):
        pytest.skip("jax_cluster ops not available")
    cfg = transformers.DeepseekV2Config(**BASE, **FUSABLE)
    hf, model = hf_roundtrip(cfg, tmp_path)
    if not hf_has_mscale(hf, cfg):
        _align_hf_scale(hf, model.config)
    errs = {}
    for impl in ("xla", "fused"):
        with ops.record_routes() as routes:
            errs[impl] = compare_logits(hf, from_pretrained(tmp_path, dtype="bf16", impl=impl),
                                        prompt_lengths=(5, 12), decode_steps=8)["decode"]
    assert errs["xla"] <= 0.08, errs
    assert errs["fused"] <= 1.25 * errs["xla"] + 5e-3, errs
    routes = [str(r) for r in routes]
    for block in ("mla_decode", "swiglu", "moe"):
        assert f"{block}: jax_cluster (C++ CPU handler, no GPU)" in routes, routes


def test_fused_moe_fp32_runs_its_shared_experts_in_the_op(tmp_path):
    """float32 under impl mlp=fused: moe_decode's CPU handler takes the routed and the shared
    experts (no separate swiglu call, which would have no float32 path)."""
    if not ops.fused_available("moe_decode"):
        pytest.skip("jax_cluster.moe_decode not available")
    cfg = dict(FUSABLE, first_k_dense_replace=0)
    hf, model = hf_roundtrip(transformers.DeepseekV2Config(**BASE, **cfg), tmp_path)
    del hf
    from flax_models.engine import decode_routes

    routes = [str(r) for r in decode_routes(model, 1, 16, "attention=xla,mlp=fused")]
    assert "moe: jax_cluster (C++ CPU handler, no GPU)" in routes, routes
    assert not any(r.startswith("moe shared experts") or r.startswith("swiglu") for r in routes), routes


def test_wrong_softmax_scale_is_detected(tmp_path, monkeypatch):
    """Negative control: dropping the mscale^2 factor must fail the comparison by a wide margin."""
    cfg = transformers.DeepseekV2Config(**BASE, **CONFIGS["qlora-moe4-top2-yarn"])
    hf, model = hf_roundtrip(cfg, tmp_path)
    if not hf_has_mscale(hf, cfg):
        _align_hf_scale(hf, model.config)
    plain = lambda c: c.qk_head_dim ** -0.5  # noqa: E731
    monkeypatch.setattr(mla, "softmax_scale", plain)
    monkeypatch.setattr(ds, "softmax_scale", plain)
    err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=4)
    assert err["prefill"] > 100 * TOL and err["decode"] > 100 * TOL, err


def test_installed_transformers_softmax_scale():
    """Records what the installed transformers does (see module docstring); both behaviours are handled."""
    cfg = transformers.DeepseekV2Config(**BASE, **CONFIGS["qlora-moe4-top2-yarn"])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    scale = hf.model.layers[0].self_attn.scaling
    m = 0.1 * 0.707 * math.log(4.0) + 1.0
    assert scale == pytest.approx(16 ** -0.5 * m * m, rel=1e-9) or scale == pytest.approx(16 ** -0.5, rel=1e-9)


def _v2_lite(**rope):
    return DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                            num_layers=27, num_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, rope=RopeConfig(**rope))


def test_softmax_scale_formula_against_hand_computed_values():
    """YaRN: sqrt(1/t) = 0.1 ln(s) + 1, with DeepSeek's mscale_all_dim weight on ln(s), squared in the logits.

    DeepSeek-V2-Lite: qk_head_dim = 192, factor 40, mscale_all_dim 0.707:
    m = 0.1 * 0.707 * ln 40 + 1 = 1.2608038..., scale = 192^-1/2 * m^2 = 0.1147214...
    """
    cfg = _v2_lite(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                   mscale=0.707, mscale_all_dim=0.707)
    m = 0.1 * 0.707 * 3.6888794541139363 + 1.0
    assert m == pytest.approx(1.2608037774, rel=1e-9)
    assert mla.softmax_scale(cfg) == pytest.approx(0.0721687836487032 * m * m, rel=1e-12)
    assert mla.softmax_scale(cfg) == pytest.approx(0.11472139, rel=1e-6)
    # no scaling, factor <= 1, or no mscale_all_dim: the plain 1/sqrt(d)
    assert mla.softmax_scale(_v2_lite()) == pytest.approx(192 ** -0.5)
    assert mla.softmax_scale(_v2_lite(rope_type="yarn", factor=1.0, original_max_position_embeddings=4096,
                                      mscale_all_dim=0.707)) == pytest.approx(192 ** -0.5)
    assert mla.softmax_scale(_v2_lite(rope_type="yarn", factor=40.0,
                                      original_max_position_embeddings=4096)) == pytest.approx(192 ** -0.5)


# DeepSeek-V3's layer is V2's with a sigmoid router whose expert choice adds a correction bias
# (topk_method noaux_tc): under impl fused the router runs in moe_decode's router call as V2's does.
V3 = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=4,
          kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
          num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2,
          norm_topk_prob=True, routed_scaling_factor=2.5)


def _v3_roundtrip(tmp_path, impl, dtype="fp32", **overrides):
    """A random tiny DeepSeek-V3 whose correction biases are not zero (they pick experts the
    scores alone would not), saved and loaded."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**BASE, **{**V3, **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for layer in hf.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.5)
    hf.save_pretrained(str(tmp_path))
    return hf, from_pretrained(tmp_path, dtype=dtype, impl=impl)


def test_deepseek_v3_matches_transformers(tmp_path):
    hf, model = _v3_roundtrip(tmp_path, "xla")
    assert model.config.topk_method == "noaux_tc"
    bias = model.layers[1].moe.score_bias[...]
    np.testing.assert_array_equal(np.asarray(bias), hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
    err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=16)
    assert err["prefill"] <= TOL, err
    assert err["decode"] <= TOL, err


def test_deepseek_v3_router_stays_float32_in_a_bf16_model(tmp_path):
    """A bf16 model keeps the router and the correction bias as transformers does, in float32
    and bit for bit: rounded to bf16 they would choose other experts where two are near-tied."""
    hf, model = _v3_roundtrip(tmp_path, "xla", dtype="bf16")
    moe, gate = model.layers[1].moe, hf.model.layers[1].mlp.gate
    assert moe.score_bias[...].dtype == jnp.float32 and moe.router[...].dtype == jnp.float32
    assert model.layers[1].attn.o.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(moe.score_bias[...]), gate.e_score_correction_bias.numpy())
    np.testing.assert_array_equal(np.asarray(moe.router[...]), gate.weight.detach().numpy().T)


def test_deepseek_v3_fused_on_cpu_matches_transformers(tmp_path, monkeypatch):
    """fp32 decode with MLA on mla_decode and V3's router, the routed and shared experts on
    moe_decode (C++ CPU handlers; the dense layer's SwiGLU on XLA: swiglu has no float32 path)."""
    if not (ops.fused_available("mla_decode") and ops.fused_available("moe_decode")):
        pytest.skip("jax_cluster.mla_decode / moe_decode not available")
    hf, model = _v3_roundtrip(tmp_path, "fused")
    routes = _fp32_fused_decode_matches(hf, model, monkeypatch)
    assert not any(r.startswith("moe shared experts") for r in routes), routes  # inside the call


def test_deepseek_v3_config_rules():
    base = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=8, hidden_size=8,
                intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, kv_lora_rank=4, qk_nope_head_dim=2,
                qk_rope_head_dim=2, v_head_dim=2, n_routed_experts=4, n_group=2, topk_group=1)
    assert DeepseekV2Config.from_hf(base).topk_method == "noaux_tc"
    with pytest.raises(ValueError, match="noaux_tc scores with sigmoid"):
        DeepseekV2Config.from_hf(dict(base, scoring_func="softmax"))
    with pytest.raises(ValueError, match="needs n_group and topk_group"):
        DeepseekV2Config.from_hf(dict(base, n_group=None))
    with pytest.raises(ValueError, match="rope_interleave"):
        DeepseekV2Config.from_hf(dict(base, rope_interleave=False))
