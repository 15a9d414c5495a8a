"""jax_cluster: fused NVIDIA Hopper kernels for LLM decoding and DiT attention.

Every op is a JAX primitive backed by an XLA FFI custom call, with a CPU
handler (plain C++) and a CUDA handler (the fused kernel). jnp references of
every op live in `jax_cluster.reference`.
"""

from jax_cluster import reference
from jax_cluster._extension import cuda_module_built, register_targets
from jax_cluster.ops.attention_block import AttentionBlockConfig, attention_block
from jax_cluster.ops.cluster_collectives import ClusterCollectiveConfig, cluster_gather, cluster_reduce
from jax_cluster.ops.decode_attention import DecodeAttentionConfig, decode_attention, decode_attention_append
from jax_cluster.ops.decoder_layer import decoder_layer
from jax_cluster.ops.flash_attention import FlashAttentionConfig, flash_attention
from jax_cluster.ops.linear import LinearConfig, linear
from jax_cluster.ops.mla_decode import MlaDecodeConfig, mla_decode
from jax_cluster.ops.moe_decode import MoeDecodeConfig, moe_decode, moe_experts
from jax_cluster.ops.swiglu import SwigluConfig, swiglu, swiglu_tp

__version__ = "0.1.0"

register_targets()

__all__ = [
    "AttentionBlockConfig",
    "ClusterCollectiveConfig",
    "DecodeAttentionConfig",
    "FlashAttentionConfig",
    "LinearConfig",
    "MlaDecodeConfig",
    "MoeDecodeConfig",
    "SwigluConfig",
    "attention_block",
    "cluster_gather",
    "cluster_reduce",
    "cuda_module_built",
    "decode_attention",
    "decode_attention_append",
    "decoder_layer",
    "flash_attention",
    "linear",
    "mla_decode",
    "moe_decode",
    "moe_experts",
    "reference",
    "register_targets",
    "swiglu",
    "swiglu_tp",
]
