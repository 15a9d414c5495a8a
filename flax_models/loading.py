"""``from_pretrained``: a Hugging Face directory (config.json + safetensors, single file or sharded
with model.safetensors.index.json, optional tokenizer.json) -> one of our models.

The model is never initialised randomly: its structure comes from ``nnx.eval_shape`` (shapes only),
then every parameter is filled from the checkpoint (hf_maps.py says how). Missing, unexpected and
wrongly shaped tensors raise errors naming the tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from flax.nnx import traversals

from . import hf_maps
from .config import config_from_hf
from .models import MODEL_CLASSES

DTYPES = {
    "float32": jnp.float32, "fp32": jnp.float32, "float16": jnp.float16, "fp16": jnp.float16,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
}


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config describes."""


def parse_dtype(dtype, default=jnp.float32):
    if dtype is None:
        return default
    if isinstance(dtype, str):
        try:
            return DTYPES[dtype.replace("torch.", "")]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}") from None
    return jnp.dtype(dtype).type


class SafetensorsReader:
    """Name -> tensor over one or several .safetensors files (lazy, via the safetensors library)."""

    def __init__(self, path: Path):
        from safetensors import safe_open  # noqa: PLC0415

        self._stack = contextlib.ExitStack()
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        self._handles = {}
        for f in files:
            if not (path / f).exists():
                raise FileNotFoundError(f"shard {f} listed in {index.name} is missing from {path}")
            self._handles[f] = self._stack.enter_context(safe_open(str(path / f), framework="flax"))
        self._where = {}
        for f, h in self._handles.items():
            for name in h.keys():
                if name in self._where:
                    raise CheckpointError(f"tensor {name!r} appears in both {self._where[name]} and {f}")
                self._where[name] = f
        if weight_map is not None:
            for name, f in weight_map.items():
                if self._where.get(name) != f:
                    raise CheckpointError(f"tensor {name!r}: the index says {f}, but it is not in that file")

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name):
        return name in self._where

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name):
        return self._handles[self._where[name]].get_tensor(name)

    def close(self):
        self._stack.close()


def checkpoint_dtype(hf: dict):
    """The dtype a config.json declares (``dtype``, or the older ``torch_dtype``), float32 if none."""
    return parse_dtype(hf.get("dtype") or hf.get("torch_dtype"), jnp.float32)


def read_config(path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found")
    return json.loads(cfg_file.read_text())


def load_tokenizer(path):
    """tokenizers.Tokenizer from path/tokenizer.json, or None when there is none."""
    f = Path(path) / "tokenizer.json"
    if not f.exists():
        return None
    from tokenizers import Tokenizer  # noqa: PLC0415

    return Tokenizer.from_file(str(f))


def abstract_model(cfg, dtype, impl="auto"):
    """The model's structure with ShapeDtypeStructs for parameters (nothing allocated)."""
    cls = MODEL_CLASSES[cfg.architecture]
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, impl=impl, rngs=nnx.Rngs(0)))


def fill(abstract, values: dict):
    """Merges {state path: array} into an abstract model; every parameter must be given."""
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    missing = [p for p in flat if p not in values]
    if missing:
        raise CheckpointError(f"no value for parameter(s) {['.'.join(map(str, p)) for p in missing[:5]]}")
    nnx.replace_by_pure_dict(state, traversals.unflatten_mapping(values))
    return nnx.merge(graphdef, state)


def param_dtypes(abstract) -> dict:
    """{state path: dtype} of an abstract model's parameters (a model may keep some float32
    in a 16-bit model: DeepSeek's router and V3's correction bias)."""
    _, state = nnx.split(abstract)
    return {path: var.get_value().dtype for path, var in nnx.to_flat_state(state)}


def load_weights(reader, cfg, dtypes: dict) -> dict:
    """{state path: array} for cfg's model from a reader (names(), shape(name), get(name)), each
    tensor cast to its parameter's dtype (`dtypes`: param_dtypes of the model it fills)."""
    available = reader.names()
    used: set[str] = set()
    values = {}
    for spec in hf_maps.specs_for(cfg):
        source = next((s for s in spec.sources if all(n in available for n in s.names)), None)
        if source is None:
            first = spec.sources[0]
            missing = [n for n in first.names if n not in available]
            raise CheckpointError(f"missing tensor {missing[0]!r} (needed for {'.'.join(map(str, spec.target))})"
                                  + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        arrays = []
        for name, shape in zip(source.names, source.shapes):
            got = reader.shape(name)
            if got != tuple(shape):
                raise CheckpointError(f"tensor {name!r} has shape {got}, expected {tuple(shape)}")
            arrays.append(jnp.asarray(reader.get(name)).astype(dtypes[spec.target]))
            used.add(name)
        values[spec.target] = source.combine(*arrays)
    extra = sorted(n for n in available - used if not hf_maps.ignored(n, cfg))
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} in the checkpoint"
                              + (f" (and {len(extra) - 1} more: {extra[1:4]})" if len(extra) > 1 else ""))
    return values


def check_shapes(abstract, values: dict):
    _, state = nnx.split(abstract)
    for path, var in nnx.to_flat_state(state):
        want = var.get_value()
        got = values[path]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"parameter {'.'.join(map(str, path))}: built shape {got.shape}, model expects "
                                  f"{want.shape}")


def from_pretrained(path, dtype=None, *, impl="auto", return_tokenizer: bool = False):
    """Loads a Hugging Face checkpoint directory into a Llama, GPTNeoX or DeepseekV2 model.

    dtype: jnp dtype or "bf16"/"fp16"/"fp32"/...; default: the checkpoint's declared dtype (fp32 if
    none). impl: "auto" | "xla" | "fused" or a dict per component ("attention", "mlp").
    Returns the model, or (model, tokenizer or None) with return_tokenizer=True.
    """
    path = Path(os.fspath(path))
    hf = read_config(path)
    cfg = config_from_hf(hf)
    dtype = parse_dtype(dtype, default=checkpoint_dtype(hf))
    abstract = abstract_model(cfg, dtype, impl)
    reader = SafetensorsReader(path)
    try:
        values = load_weights(reader, cfg, param_dtypes(abstract))
    finally:
        reader.close()
    check_shapes(abstract, values)
    model = fill(abstract, values)
    if return_tokenizer:
        return model, load_tokenizer(path)
    return model
