"""Flax NNX decoders (Llama, GPT-NeoX/Pythia, DeepSeek-V2) with Hugging Face loading, KV-cached
generation and a command line (``python -m flax_models.generate``). Never imports jax_cluster at
import time: fused ops are loaded lazily by :mod:`flax_models.ops`.
"""

from .cache import KVCache, LatentCache, PagedLatentCache
from .config import DeepseekV2Config, GPTNeoXConfig, LlamaConfig, RopeConfig, config_from_hf
from .deepseek_v2 import DeepseekV2
from .gpt_neox import GPTNeoX
from .llama import Llama
from .loading import CheckpointError, from_pretrained, load_tokenizer

__all__ = [
    "CheckpointError", "DeepseekV2", "DeepseekV2Config", "GPTNeoX", "GPTNeoXConfig", "KVCache", "LatentCache",
    "Llama", "LlamaConfig", "PagedLatentCache", "RopeConfig", "config_from_hf", "from_pretrained", "load_tokenizer",
]
