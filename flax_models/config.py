"""Model configurations, parsed from Hugging Face ``config.json`` dictionaries.

One frozen dataclass per architecture (hashable, so a config can be a static jit argument) plus
:class:`RopeConfig`, which keeps every RoPE variant's parameters; the inverse frequencies are computed
from it in :mod:`flax_models.rope`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# Mistral and Qwen2 are Llama's layer: Qwen2 with q, k, v biases, either with sliding
# attention windows (LlamaConfig.from_hf).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "GPTNeoXForCausalLM": "gpt_neox",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v2",  # V2's layer with V3's router (topk_method noaux_tc)
}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt_neox": "gpt_neox",
               "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v2"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``rope_type`` is one of default, linear, llama3, yarn."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], default_theta: float = 10000.0) -> "RopeConfig":
        """Reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older)."""
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        params = dict(params)
        theta = params.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", default_theta)))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        known = {"default", "linear", "llama3", "yarn"}
        if rope_type not in known:
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {sorted(known)})")
        orig = params.get("original_max_position_embeddings")
        if rope_type == "yarn" and orig is None:
            orig = cfg.get("max_position_embeddings")
        factor = params.get("factor")
        if factor is None:
            factor = 1.0
            if rope_type == "yarn" and orig:
                factor = cfg["max_position_embeddings"] / orig
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=None if orig is None else int(orig),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


def _eos(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _sliding_layers(cfg: Mapping[str, Any]) -> tuple[int | None, tuple[bool, ...]]:
    """(window, which layers attend through it) of a Mistral or Qwen2 config, as transformers
    reads it: ``layer_types`` where given; Qwen2 with use_sliding_window from layer
    max_window_layers on; Mistral every layer. (None, ()) where no layer slides."""
    window = cfg.get("sliding_window")
    layers = int(cfg["num_hidden_layers"])
    if not window:
        return None, ()
    types = cfg.get("layer_types")
    if types is not None:
        sliding = tuple(t == "sliding_attention" for t in types)
    elif cfg.get("model_type") == "qwen2":
        first = int(cfg.get("max_window_layers", 28)) if cfg.get("use_sliding_window") else layers
        sliding = tuple(i >= first for i in range(layers))
    else:
        sliding = (True,) * layers
    return (int(window), sliding) if any(sliding) else (None, ())


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig = RopeConfig()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v (and o_proj unless o_proj_bias says otherwise)
    o_proj_bias: bool | None = None  # None: attention_bias (Llama); Qwen2: False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    # Mistral's and Qwen2's sliding window: layer i attends to its last sliding_window tokens
    # (itself included) where sliding_layers[i]
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    architecture: str = "llama"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias if self.o_proj_bias is None else self.o_proj_bias

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window, None where it attends to every earlier token."""
        return self.sliding_window if i < len(self.sliding_layers) and self.sliding_layers[i] else None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LlamaConfig":
        """Llama, Mistral and Qwen2 configs (Mistral's and Qwen2's sliding attention windows
        included)."""
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Llama: unsupported hidden_act {act!r} (only 'silu')")
        heads = int(cfg["num_attention_heads"])
        bias = bool(cfg.get("attention_bias") or False)
        qwen2 = cfg.get("model_type") == "qwen2"  # q, k, v always with biases, o_proj never
        context = int(cfg.get("max_position_embeddings", 4096))
        window, sliding = _sliding_layers(cfg)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rope=RopeConfig.from_hf(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias or qwen2,
            o_proj_bias=False if qwen2 else None,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=context,
            sliding_window=window,
            sliding_layers=sliding,
            eos_token_ids=_eos(cfg),
        )


@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    rotary_dim: int
    rope: RopeConfig = RopeConfig()
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = True
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "gpt_neox"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "GPTNeoXConfig":
        act = cfg.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-NeoX: unsupported hidden_act {act!r}")
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg["hidden_size"]) // heads
        rp = cfg.get("rope_parameters") or {}
        pct = rp.get("partial_rotary_factor", cfg.get("rotary_pct", cfg.get("partial_rotary_factor", 0.25)))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            rotary_dim=int(head_dim * float(pct)),
            rope=RopeConfig.from_hf(cfg),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
            use_parallel_residual=bool(cfg.get("use_parallel_residual", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", True)),
            hidden_act=act,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_ids=_eos(cfg),
        )


@dataclasses.dataclass(frozen=True)
class DeepseekV2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # greedy, group_limited_greedy (V2), noaux_tc (V3: sigmoid scores)
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    rope: RopeConfig = RopeConfig()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "deepseek_v2"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.n_routed_experts is not None
            and self.n_routed_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "DeepseekV2Config":
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"DeepSeek-V2: unsupported hidden_act {act!r} (only 'silu')")
        v3 = cfg.get("model_type") == "deepseek_v3" or "DeepseekV3ForCausalLM" in (cfg.get("architectures") or ())
        method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"DeepSeek-V2: unsupported topk_method {method!r}")
        scoring = cfg.get("scoring_func") or ("sigmoid" if method == "noaux_tc" else "softmax")
        if scoring != ("sigmoid" if method == "noaux_tc" else "softmax"):
            raise ValueError(f"DeepSeek-V2: unsupported scoring_func {scoring!r} with topk_method {method!r} "
                             "(noaux_tc scores with sigmoid, the others with softmax)")
        if method == "noaux_tc" and not (cfg.get("n_group") and cfg.get("topk_group")):
            raise ValueError("DeepSeek-V3: topk_method 'noaux_tc' needs n_group and topk_group")
        if cfg.get("rope_interleave", True) is False:
            raise ValueError("DeepSeek: only interleaved rotary dimensions are supported (rope_interleave false)")
        q_lora = cfg.get("q_lora_rank")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1407)),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            n_routed_experts=cfg.get("n_routed_experts"),
            n_shared_experts=cfg.get("n_shared_experts"),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            topk_method=method,
            n_group=cfg.get("n_group"),
            topk_group=cfg.get("topk_group"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            rope=RopeConfig.from_hf(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=_eos(cfg),
        )


CONFIG_CLASSES = {"llama": LlamaConfig, "gpt_neox": GPTNeoXConfig, "deepseek_v2": DeepseekV2Config}


def architecture_of(cfg: Mapping[str, Any]) -> str:
    """Our architecture name for a Hugging Face config dict; ValueError naming it if unknown."""
    for arch in cfg.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if cfg.get("model_type") in MODEL_TYPES and not cfg.get("architectures"):
        return MODEL_TYPES[cfg["model_type"]]
    raise ValueError(
        f"unknown architecture {cfg.get('architectures')!r} (model_type {cfg.get('model_type')!r}); "
        f"supported: {sorted(ARCHITECTURES)}"
    )


def config_from_hf(cfg: Mapping[str, Any]):
    return CONFIG_CLASSES[architecture_of(cfg)].from_hf(cfg)
