"""Hugging Face tensor names -> our parameters, per architecture.

Each :class:`Spec` fills one parameter (a path in the model's NNX state) from one or more checkpoint
tensors with expected shapes (HF stores Linear weights [out, in]; ours are [in, out]). A spec may
list alternatives (e.g. per-expert tensors, or transformers 5's stacked expert tensors); the first
one whose tensors are all present is used.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Source:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: Callable  # (*arrays) -> array in our layout


@dataclasses.dataclass(frozen=True)
class Spec:
    target: tuple  # path in the NNX state, e.g. ("layers", 0, "qkv", "kernel")
    sources: tuple[Source, ...]


def _t(a):
    return jnp.swapaxes(a, -1, -2)


def _ident(a):
    return a


def _one(target, name, shape, combine=_ident):
    return Spec(tuple(target), (Source((name,), (tuple(shape),), combine),))


def _linear(specs, target, prefix, d_in, d_out, bias):
    specs.append(_one((*target, "kernel"), f"{prefix}.weight", (d_out, d_in), _t))
    if bias:
        specs.append(_one((*target, "bias"), f"{prefix}.bias", (d_out,)))


def _concat_t(*ws):
    return jnp.concatenate([_t(w) for w in ws], axis=1)


def _concat(*bs):
    return jnp.concatenate(bs, axis=0)


def _head(specs, cfg, embed_name, head_name):
    specs.append(_one(("embed", "embedding"), embed_name, (cfg.vocab_size, cfg.hidden_size)))
    if not cfg.tie_word_embeddings:
        _linear(specs, ("lm_head",), head_name[: -len(".weight")], cfg.hidden_size, cfg.vocab_size, False)


# ----------------------------------------------------------------------------- Llama
def llama_specs(cfg) -> list[Spec]:
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    specs: list[Spec] = []
    _head(specs, cfg, "model.embed_tokens.weight", "lm_head.weight")
    specs.append(_one(("norm", "weight"), "model.norm.weight", (h,)))
    for i in range(cfg.num_layers):
        p, t = f"model.layers.{i}", ("layers", i)
        specs.append(_one((*t, "input_norm", "weight"), f"{p}.input_layernorm.weight", (h,)))
        specs.append(_one((*t, "post_norm", "weight"), f"{p}.post_attention_layernorm.weight", (h,)))
        names = tuple(f"{p}.self_attn.{n}_proj" for n in "qkv")
        outs = (hq * d, hkv * d, hkv * d)
        specs.append(Spec((*t, "qkv", "kernel"), (Source(
            tuple(n + ".weight" for n in names), tuple((o, h) for o in outs), _concat_t),)))
        if cfg.attention_bias:
            specs.append(Spec((*t, "qkv", "bias"), (Source(
                tuple(n + ".bias" for n in names), tuple((o,) for o in outs), _concat),)))
        _linear(specs, (*t, "o"), f"{p}.self_attn.o_proj", hq * d, h, cfg.o_bias)
        for ours, theirs, din, dout in (("gate", "gate_proj", h, cfg.intermediate_size),
                                        ("up", "up_proj", h, cfg.intermediate_size),
                                        ("down", "down_proj", cfg.intermediate_size, h)):
            _linear(specs, (*t, "mlp", ours), f"{p}.mlp.{theirs}", din, dout, cfg.mlp_bias)
    return specs


# ----------------------------------------------------------------------------- GPT-NeoX
def neox_qkv_weight(w, num_heads):
    """HF [3 H, hidden] rows ordered (head, {q,k,v}, d) -> ours [hidden, 3 H] columns ({q,k,v}, head, d)."""
    three_h, hidden = w.shape
    d = three_h // (3 * num_heads)
    return _t(w.reshape(num_heads, 3, d, hidden).transpose(1, 0, 2, 3).reshape(three_h, hidden))


def neox_qkv_bias(b, num_heads):
    d = b.shape[0] // (3 * num_heads)
    return b.reshape(num_heads, 3, d).transpose(1, 0, 2).reshape(-1)


def gpt_neox_specs(cfg) -> list[Spec]:
    h, nh = cfg.hidden_size, cfg.num_heads
    specs: list[Spec] = []
    _head(specs, cfg, "gpt_neox.embed_in.weight", "embed_out.weight")
    for n in ("weight", "bias"):
        specs.append(_one(("final_norm", n), f"gpt_neox.final_layer_norm.{n}", (h,)))
    for i in range(cfg.num_layers):
        p, t = f"gpt_neox.layers.{i}", ("layers", i)
        for ours, theirs in (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm")):
            for n in ("weight", "bias"):
                specs.append(_one((*t, ours, n), f"{p}.{theirs}.{n}", (h,)))
        specs.append(_one((*t, "qkv", "kernel"), f"{p}.attention.query_key_value.weight", (3 * h, h),
                          lambda w: neox_qkv_weight(w, nh)))
        if cfg.attention_bias:
            specs.append(_one((*t, "qkv", "bias"), f"{p}.attention.query_key_value.bias", (3 * h,),
                              lambda b: neox_qkv_bias(b, nh)))
        _linear(specs, (*t, "o"), f"{p}.attention.dense", h, h, cfg.attention_bias)
        _linear(specs, (*t, "mlp", "fc_in"), f"{p}.mlp.dense_h_to_4h", h, cfg.intermediate_size, True)
        _linear(specs, (*t, "mlp", "fc_out"), f"{p}.mlp.dense_4h_to_h", cfg.intermediate_size, h, True)
    return specs


# ----------------------------------------------------------------------------- DeepSeek-V2
def _stack_t(*ws):
    return jnp.stack([_t(w) for w in ws])


def deepseek_v2_specs(cfg) -> list[Spec]:
    h, nh = cfg.hidden_size, cfg.num_heads
    r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    specs: list[Spec] = []
    _head(specs, cfg, "model.embed_tokens.weight", "lm_head.weight")
    specs.append(_one(("norm", "weight"), "model.norm.weight", (h,)))
    bias = cfg.attention_bias
    for i in range(cfg.num_layers):
        p, t = f"model.layers.{i}", ("layers", i)
        a, at = f"{p}.self_attn", (*t, "attn")
        specs.append(_one((*t, "input_norm", "weight"), f"{p}.input_layernorm.weight", (h,)))
        specs.append(_one((*t, "post_norm", "weight"), f"{p}.post_attention_layernorm.weight", (h,)))
        if cfg.q_lora_rank is None:
            _linear(specs, (*at, "q"), f"{a}.q_proj", h, nh * cfg.qk_head_dim, False)
        else:
            _linear(specs, (*at, "q_a"), f"{a}.q_a_proj", h, cfg.q_lora_rank, bias)
            specs.append(_one((*at, "q_a_norm", "weight"), f"{a}.q_a_layernorm.weight", (cfg.q_lora_rank,)))
            _linear(specs, (*at, "q_b"), f"{a}.q_b_proj", cfg.q_lora_rank, nh * cfg.qk_head_dim, False)
        _linear(specs, (*at, "kv_a"), f"{a}.kv_a_proj_with_mqa", h, r + dr, bias)
        specs.append(_one((*at, "kv_a_norm", "weight"), f"{a}.kv_a_layernorm.weight", (r,)))
        _linear(specs, (*at, "kv_b"), f"{a}.kv_b_proj", r, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), False)
        _linear(specs, (*at, "o"), f"{a}.o_proj", nh * cfg.v_head_dim, h, bias)
        m = f"{p}.mlp"
        if not cfg.is_moe_layer(i):
            for ours, theirs, din, dout in (("gate", "gate_proj", h, cfg.intermediate_size),
                                            ("up", "up_proj", h, cfg.intermediate_size),
                                            ("down", "down_proj", cfg.intermediate_size, h)):
                _linear(specs, (*t, "mlp", ours), f"{m}.{theirs}", din, dout, False)
            continue
        e, im = cfg.n_routed_experts, cfg.moe_intermediate_size
        mt = (*t, "moe")
        specs.append(_one((*mt, "router"), f"{m}.gate.weight", (e, h), _t))
        if cfg.topk_method == "noaux_tc":
            specs.append(_one((*mt, "score_bias"), f"{m}.gate.e_score_correction_bias", (e,)))
        for ours, theirs, shape in (("w_gate", "gate_proj", (im, h)), ("w_up", "up_proj", (im, h)),
                                    ("w_down", "down_proj", (h, im))):
            per_expert = Source(tuple(f"{m}.experts.{j}.{theirs}.weight" for j in range(e)), (shape,) * e, _stack_t)
            if theirs == "down_proj":
                stacked = Source((f"{m}.experts.down_proj",), ((e, h, im),), _t)
            else:
                half = slice(0, im) if theirs == "gate_proj" else slice(im, 2 * im)
                stacked = Source((f"{m}.experts.gate_up_proj",), ((e, 2 * im, h),), lambda w, s=half: _t(w[:, s]))
            specs.append(Spec((*mt, ours), (per_expert, stacked)))
        if cfg.n_shared_experts:
            ish = im * cfg.n_shared_experts
            for ours, theirs, din, dout in (("gate", "gate_proj", h, ish), ("up", "up_proj", h, ish),
                                            ("down", "down_proj", ish, h)):
                _linear(specs, (*mt, "shared", ours), f"{m}.shared_experts.{theirs}", din, dout, False)
    return specs


SPECS = {"llama": llama_specs, "gpt_neox": gpt_neox_specs, "deepseek_v2": deepseek_v2_specs}

# Buffers some checkpoints carry that are not parameters (recomputed here from the config).
IGNORED = [re.compile(p) for p in (
    r".*\.rotary_emb\.inv_freq$",
    r".*\.attention\.(masked_)?bias$",
)]


def ignored(name: str, cfg) -> bool:
    if cfg.tie_word_embeddings and name in ("lm_head.weight", "embed_out.weight"):
        return True  # a tied head stored anyway: it equals the embedding
    return any(p.match(name) for p in IGNORED)


def specs_for(cfg) -> Sequence[Spec]:
    return SPECS[cfg.architecture](cfg)
