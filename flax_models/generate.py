"""Command line: generate text with a Hugging Face checkpoint directory or a built-in preset.

    python -m flax_models.generate --model tiny-llama --prompt "Hello" --max-new-tokens 32

Prints each row's text (token ids when there is no tokenizer), then how every decode block ran
(a jax_cluster op, or XLA and why), the compile time, prefill time, time per output token and
decode tokens/s. Presets have random weights and no tokenizer: the prompt is then fed as its
UTF-8 bytes (modulo the vocabulary size). Every bad argument is a one-line error (exit code 2)
before any weight is made or loaded.
"""

from __future__ import annotations

import argparse
import logging
import sys

import jax
import jax.numpy as jnp

from . import ops
from .engine import cache_slots, decode_routes, generate, pad_prompts
from .loading import abstract_model, checkpoint_dtype, load_tokenizer, parse_dtype, read_config
from .presets import PRESETS, load_model, resolve_model
from .sampling import SamplingParams


class UsageError(Exception):
    """A bad argument: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, not the usage block
        raise UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m flax_models.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama",
                   help=f"Hugging Face checkpoint directory or preset ({', '.join(sorted(PRESETS))}); "
                        "default tiny-llama")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for several prompts (of different lengths) in one batch")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32)
    p.add_argument("--impl", default="auto",
                   help="auto | xla | fused (fused: whole layers on the one-launch layer kernel where the model "
                        "has one), or per component of attention, mlp, layer: attention=fused,mlp=fused "
                        "(default auto; see docs/models.md)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="default: the checkpoint's dtype; for presets bf16, or fp32 on CPU unless an "
                        "op runs fused")
    p.add_argument("--batch", type=_positive_int, default=None,
                   help="rows (the prompts are repeated to fill it); default: one row per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens tokens")
    p.add_argument("--no-progress", action="store_true", help="no progress bar and no kernel-tuning messages")
    p.add_argument("--page-size", type=_positive_int, default=None,
                   help="DeepSeek models: keep the latent cache in pages of this many tokens")
    p.add_argument("--data-parallel", type=_positive_int, default=1, metavar="N",
                   help="split the batch's rows over N devices (weights replicated on each)")
    return p


def encode(prompt: str, tokenizer, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer.encode(prompt).ids
    else:
        ids = [b % vocab_size for b in prompt.encode("utf-8")]
    return ids or [0]


def _check_context(rows, max_new_tokens: int, context: int) -> None:
    for i, ids in enumerate(rows):
        if len(ids) > context:
            raise UsageError(f"prompt {i} is {len(ids)} tokens, longer than the model's context of {context} "
                             "tokens (max_position_embeddings)")
        if len(ids) + max_new_tokens > context:
            raise UsageError(f"prompt {i} ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                             f"model's context of {context} tokens (max_position_embeddings); "
                             f"use --max-new-tokens {context - len(ids)} or less")


def _prepare(args):
    """Everything that can be checked before any weight exists: (cfg, path, dtype, impl, sampling,
    tokenizer, rows, routes). Raises UsageError."""
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
        impl = ops.normalize_impl(args.impl)
        cfg, path = resolve_model(args.model)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    if args.dtype is not None:
        dtype = parse_dtype(args.dtype)
    elif path is not None:
        dtype = checkpoint_dtype(read_config(path))
    else:  # a preset: bf16 on a GPU; on CPU fp32, or bf16 where an op is asked to run fused
        # (jax_cluster.swiglu, the fused MLP, takes 16-bit activations only, on CPU too)
        fused = impl == "fused" or (isinstance(impl, tuple) and any(v == "fused" for _, v in impl))
        dtype = jnp.bfloat16 if jax.default_backend() != "cpu" or fused else jnp.float32
    tokenizer = load_tokenizer(path) if path is not None else None
    prompts = args.prompt or ["The quick brown fox"]
    batch = args.batch or len(prompts)
    rows = [encode(prompts[i % len(prompts)], tokenizer, cfg.vocab_size) for i in range(batch)]
    _check_context(rows, args.max_new_tokens, cfg.max_position_embeddings)
    tokens, _ = pad_prompts(rows)
    if args.data_parallel > 1:
        if args.data_parallel > len(jax.devices()):
            raise UsageError(f"--data-parallel {args.data_parallel}: only {len(jax.devices())} devices here")
        if batch % args.data_parallel:
            raise UsageError(f"--data-parallel {args.data_parallel}: the batch of {batch} rows does not split "
                             "evenly (set --batch to a multiple)")
        if args.page_size is not None:
            raise UsageError("--data-parallel with --page-size: a page pool is shared by the rows, it is not "
                             "split over devices")
    try:  # one decode step traced abstractly: an impl that cannot run fails here, before any weight
        routes = decode_routes(abstract_model(cfg, dtype, impl), batch,
                               cache_slots(tokens.shape[1] + args.max_new_tokens), impl, args.page_size)
    except (ValueError, RuntimeError) as e:
        hint = (" (a fused op here takes 16-bit activations: pass --dtype bf16 or fp16)"
                if jnp.dtype(dtype) == jnp.dtype(jnp.float32) and "float32" in str(e) else "")
        raise UsageError(str(e) + hint) from None
    return cfg, path, dtype, impl, sampling, tokenizer, rows, routes


def describe_routes(routes, impl_text: str) -> list[str]:
    lines = [f"decode blocks (impl={impl_text}):"]
    lines += [f"  {r}" for r in routes]
    if not ops.on_gpu() and any(r.why.startswith("no GPU") for r in routes):
        lines.append("  (--impl fused runs the jax_cluster ops' C++ CPU handlers: a check of the FFI path, "
                     "not a fast path)")
    return lines


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        cfg, path, dtype, impl, sampling, tokenizer, rows, routes = _prepare(args)
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code
    if not args.no_progress:  # the first trace on a GPU may tune kernels for a while: say so
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        tuning_log = logging.getLogger("jax_cluster.tuning")
        if not tuning_log.handlers:  # main() may run several times in one process (tests)
            tuning_log.addHandler(handler)
        tuning_log.setLevel(logging.INFO)
    model, _ = load_model(path or args.model, dtype, impl=impl, seed=args.seed)
    eos = () if args.ignore_eos or tokenizer is None else cfg.eos_token_ids
    mesh = (jax.make_mesh((args.data_parallel,), ("data",), devices=jax.devices()[:args.data_parallel],
                          axis_types=(jax.sharding.AxisType.Auto,)) if args.data_parallel > 1 else None)
    res = generate(model, rows, args.max_new_tokens, sampling=sampling, seed=args.seed, eos_token_ids=eos,
                   progress=not args.no_progress, page_size=args.page_size, mesh=mesh)
    for i, toks in enumerate(res.tokens):
        shown = tokenizer.decode(toks) if tokenizer is not None else " ".join(map(str, toks))
        label = "text" if tokenizer is not None else "token ids"
        print(f"[{i}] prompt {res.prompt_lengths[i]} tokens; {label}: {shown}")
    dev = jax.devices()[0]
    print(f"model {args.model} ({cfg.architecture}, {jnp.dtype(model.dtype).name}) "
          f"on {dev.platform}:{dev.device_kind}, batch {len(rows)}"
          + (f" over {args.data_parallel} devices" if args.data_parallel > 1 else ""))
    print("\n".join(describe_routes(routes, args.impl)))
    print(f"compile time:          {res.compile_s * 1e3:10.1f} ms")
    print(f"prefill time:          {res.prefill_s * 1e3:10.2f} ms")
    print(f"time per output token: {res.time_per_token_s * 1e3:10.3f} ms  ({res.decode_steps} decode steps)")
    print(f"tokens/s:              {res.tokens_per_s:10.1f}  (decode, all rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
