"""Generation: jitted prefill and decode steps over a split model (graphdef static, state an
argument), the cache donated to every step so it is updated in place.

``generate`` pads prompts on the right (see base.py for why), prefills once, then runs one jitted
decode step per token from Python (tokens and the rows' end-token flags stay on device, updated
inside the step; the host looks at the flags every 16 steps) and times each phase after
ahead-of-time compilation. ``decode_loop`` runs many steps inside ONE jit
(lax.fori_loop), for benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import ops
from .sampling import SamplingParams, sample


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# Cache slots are allocated in multiples of this. XLA's attention matmuls contract over the
# cache length and, for a length that is not a multiple of 32, pad a copy of the whole
# V cache on every step (docs/models.md has the measurement).
CACHE_MULTIPLE = 128


def cache_slots(tokens: int) -> int:
    """Cache length for `tokens` slots: rounded up to CACHE_MULTIPLE."""
    return _round_up(tokens, CACHE_MULTIPLE)


def init_cache(model, batch: int, max_len: int, page_size: int | None = None):
    """model.init_cache, paged where page_size is given (MLA's latent cache only)."""
    if page_size is None:
        return model.init_cache(batch, max_len)
    if "page_size" not in inspect.signature(model.init_cache).parameters:
        raise ValueError(f"a paged cache is MLA's (DeepSeek): {type(model).__name__} keeps contiguous rows")
    return model.init_cache(batch, max_len, page_size=page_size)


def decode_routes(model, batch: int, cache_len: int, impl=None, page_size: int | None = None) -> list:
    """How each block of one decode step runs (a list of :class:`flax_models.ops.Route`).

    The step is traced abstractly: nothing is computed or allocated, so ``model`` may be the
    abstract model of :func:`flax_models.loading.abstract_model`. Raises what the step would
    raise, e.g. impl="fused" where a jax_cluster op does not cover the call.
    """
    impl = model.impl if impl is None else ops.normalize_impl(impl)
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(model, batch, cache_len, page_size))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    with ops.record_routes() as routes:
        jax.eval_shape(lambda st, t, c: nnx.merge(graphdef, st).decode(t, c, impl=impl), state, tokens, cache)
    return routes


def _prefill(graphdef, sampling, state, tokens, lengths, cache, key):
    model = nnx.merge(graphdef, state)
    logits, cache = model.prefill(tokens, lengths, cache)
    key, sub = jax.random.split(key)
    return sample(logits, sub, sampling), cache, key


def _step(graphdef, sampling, impl, state, tokens, cache, key):
    model = nnx.merge(graphdef, state)
    logits, cache = model.decode(tokens, cache, impl=impl)
    key, sub = jax.random.split(key)
    return sample(logits, sub, sampling), cache, key


def _generate_step(graphdef, sampling, impl, state, tokens, cache, key, done, eos):
    """A decode step that also folds "this row has produced an end token" into done, inside
    the step's jit: no separate dispatch per token."""
    tokens, cache, key = _step(graphdef, sampling, impl, state, tokens, cache, key)
    return tokens, cache, key, done | jnp.isin(tokens, eos)


def _loop(graphdef, sampling, impl, steps, state, tokens, cache, key):
    def body(_, carry):
        tok, c, k = carry
        return _step(graphdef, sampling, impl, state, tok, c, k)

    return jax.lax.fori_loop(0, steps, body, (tokens, cache, key))


class Engine:
    """Compiled prefill / step / loop functions for one model structure and one sampling setting.

    Use :meth:`for_model`: engines are cached per (graphdef, sampling, impl), so models of the same
    structure share compiled code (weights are an argument, not a constant).
    """

    _cache: dict = {}

    @classmethod
    def for_model(cls, model, sampling: SamplingParams = SamplingParams(), impl=None) -> "Engine":
        graphdef, state = nnx.split(model)
        impl = ops.normalize_impl(impl)
        key = (graphdef, sampling, impl)
        eng = cls._cache.get(key)
        if eng is None:
            eng = cls._cache[key] = cls(model, sampling, impl)
        eng.state = state
        return eng

    def compiled(self, name: str, *args):
        """AOT-compiled prefill/step for these argument shapes and shardings (cached)."""
        sig = (name, *(jax.tree.map(lambda a: (a.shape, str(a.dtype), str(getattr(a, "sharding", None))), x)
                       for x in args))
        hit = self._compiled.get(str(sig))
        if hit is None:
            hit = self._compiled[str(sig)] = getattr(self, name).lower(*args).compile()
        return hit

    def __init__(self, model, sampling: SamplingParams = SamplingParams(), impl=None):
        self.model = model
        self.graphdef, self.state = nnx.split(model)
        self.sampling = sampling
        impl = ops.normalize_impl(impl)
        self.prefill = jax.jit(functools.partial(_prefill, self.graphdef, sampling), donate_argnums=(3,))
        self.step = jax.jit(functools.partial(_generate_step, self.graphdef, sampling, impl), donate_argnums=(2,))
        self._impl = impl
        self._compiled = {}

    def loop(self, steps: int):
        """jitted (state, tokens, cache, key) -> (tokens, cache, key) after `steps` decode steps."""
        return jax.jit(functools.partial(_loop, self.graphdef, self.sampling, self._impl, steps), donate_argnums=(2,))


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per row (cut after an end-of-sequence token)
    prompt_lengths: list[int]
    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def time_per_token_s(self) -> float:
        """Wall time of one decode step (one new token for every row)."""
        return self.decode_s / max(self.decode_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput over the whole batch."""
        return len(self.tokens) * self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")


def _data_parallel(mesh: Mesh, axis: str, batch: int, page_size: int | None):
    """(rows, whole): the shardings of a data-parallel generation, after checking it can run."""
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r} (axes: {tuple(mesh.shape)})")
    if batch % mesh.shape[axis]:
        raise ValueError(f"a batch of {batch} rows does not split evenly over the {mesh.shape[axis]} devices of "
                         f"mesh axis {axis!r}")
    if page_size is not None:
        raise ValueError("a paged latent cache is one page pool shared by the rows: it is not split over a mesh "
                         "(use the contiguous cache)")
    # The models' jnp code is not typed for Explicit axes (its gathers would need their output
    # shardings spelled out): the same devices as Auto axes, where XLA propagates the rows.
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return NamedSharding(mesh, PartitionSpec(axis)), NamedSharding(mesh, PartitionSpec())


def pad_prompts(prompts: Sequence[Sequence[int]], multiple: int = 16):
    """Right-pads prompts to a common length (rounded up to `multiple`): (tokens [B, T], lengths [B])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    t = _round_up(max(len(p) for p in prompts), multiple)
    tokens = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, np.asarray([len(p) for p in prompts], np.int32)


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             sampling: SamplingParams = SamplingParams(), seed: int = 0, eos_token_ids: Sequence[int] = (),
             impl=None, progress: bool = False, pad_multiple: int = 16,
             page_size: int | None = None, mesh: Mesh | None = None, data_axis: str = "data") -> GenerationResult:
    """Generates max_new_tokens tokens (fewer if every row ended) for a batch of prompts; with
    page_size, over a paged latent cache (DeepSeek models). With a mesh, data parallel: the
    rows (prompts, cache) sharded over its axis data_axis, the weights replicated (copied to
    the mesh's devices per call unless the model's state already is); the fused ops run each
    device's own rows (docs/sharding.md)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    tokens, lengths = pad_prompts(prompts, pad_multiple)
    b, t = tokens.shape
    cache = init_cache(model, b, cache_slots(t + max_new_tokens), page_size)
    engine = Engine.for_model(model, sampling, impl)
    state = engine.state
    key = jax.random.key(seed)
    tokens_d, lengths_d = jnp.asarray(tokens), jnp.asarray(lengths)
    if mesh is not None:
        rows, whole = _data_parallel(mesh, data_axis, b, page_size)
        tokens_d, lengths_d, cache = (jax.device_put(a, rows) for a in (tokens_d, lengths_d, cache))
        state, key = jax.device_put(state, whole), jax.device_put(key, whole)

    t0 = time.perf_counter()
    prefill = engine.compiled("prefill", state, tokens_d, lengths_d, cache, key)
    placed = lambda a: a.sharding if mesh is not None else None  # noqa: E731
    shape_of = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed(a))  # noqa: E731
    tok_shape = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=placed(tokens_d))
    eos = jnp.asarray(list(eos_token_ids) or [-1], jnp.int32)
    if mesh is not None:
        eos = jax.device_put(eos, whole)
    done_shape = jax.ShapeDtypeStruct((b,), jnp.bool_, sharding=placed(tokens_d))
    step = engine.compiled("step", state, tok_shape, jax.tree.map(shape_of, cache), key, done_shape, eos)
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    tok, cache, key = prefill(state, tokens_d, lengths_d, cache, key)
    tok.block_until_ready()
    prefill_s = time.perf_counter() - t0

    out = [tok]
    done = jnp.isin(tok, eos)
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=max_new_tokens, desc="decode", unit="tok", leave=False)
        bar.update(1)
    t0 = time.perf_counter()
    for i in range(1, max_new_tokens):
        tok, cache, key, done = step(state, tok, cache, key, done, eos)
        out.append(tok)
        if bar is not None:
            bar.update(1)
        if eos_token_ids and i % 16 == 0 and bool(done.all()):
            break
    jax.block_until_ready(tok)
    decode_s = time.perf_counter() - t0
    if bar is not None:
        bar.close()

    ids = np.asarray(jnp.stack(out, axis=1))
    rows = []
    for r in ids.tolist():
        for j, v in enumerate(r):
            if v in eos_token_ids:
                r = r[: j + 1]
                break
        rows.append(r)
    return GenerationResult(rows, lengths.tolist(), compile_s, prefill_s, decode_s, len(out) - 1)
