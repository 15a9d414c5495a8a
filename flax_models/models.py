"""Architecture name -> model class."""

from .deepseek_v2 import DeepseekV2
from .gpt_neox import GPTNeoX
from .llama import Llama

MODEL_CLASSES = {"llama": Llama, "gpt_neox": GPTNeoX, "deepseek_v2": DeepseekV2}


def build(cfg, *, dtype, impl="auto", rngs):
    return MODEL_CLASSES[cfg.architecture](cfg, dtype=dtype, impl=impl, rngs=rngs)
