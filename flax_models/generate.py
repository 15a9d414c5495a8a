"""Command line: generate text with a Hugging Face checkpoint directory or a built-in preset.

    python -m flax_models.generate --model tiny-llama --prompt "Hello" --max-new-tokens 32

Prints each row's text (token ids when there is no tokenizer), then the measured compile time,
prefill time, time per output token and decode tokens/s. Presets have random weights and no
tokenizer: the prompt is then fed as its UTF-8 bytes (modulo the vocabulary size).
"""

from __future__ import annotations

import argparse
import logging
import sys

import jax
import jax.numpy as jnp

from . import ops
from .engine import generate
from .presets import PRESETS, load_model
from .sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flax_models.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama",
                   help=f"Hugging Face directory or preset ({', '.join(sorted(PRESETS))}); default tiny-llama")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for several prompts (of different lengths) in one batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--impl", default="auto",
                   help="auto | xla | fused, or per component: attention=fused,mlp=xla (default auto)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="default: the checkpoint's dtype; for presets bf16 on GPU, fp32 on CPU")
    p.add_argument("--batch", type=int, default=None, help="rows (prompts are repeated to fill it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens tokens")
    p.add_argument("--no-progress", action="store_true", help="no progress bar and no kernel-tuning messages")
    return p


def encode(prompt: str, tokenizer, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer.encode(prompt).ids
    else:
        ids = [b % vocab_size for b in prompt.encode("utf-8")]
    return ids or [0]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.no_progress:  # the first trace on a GPU may tune kernels for a while: say so
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        tuning_log = logging.getLogger("jax_cluster.tuning")
        if not tuning_log.handlers:  # main() may run several times in one process (tests)
            tuning_log.addHandler(handler)
        tuning_log.setLevel(logging.INFO)
    prompts = args.prompt or ["The quick brown fox"]
    batch = args.batch or len(prompts)
    if batch < 1:
        print("error: --batch must be >= 1", file=sys.stderr)
        return 2
    dtype = args.dtype
    if dtype is None and args.model in PRESETS:
        dtype = "bf16" if jax.default_backend() != "cpu" else "fp32"
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
        impl = ops.normalize_impl(args.impl)
        model, tokenizer = load_model(args.model, dtype, impl=impl, seed=args.seed)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    rows = [encode(prompts[i % len(prompts)], tokenizer, cfg.vocab_size) for i in range(batch)]
    eos = () if args.ignore_eos or tokenizer is None else cfg.eos_token_ids
    try:
        res = generate(model, rows, args.max_new_tokens, sampling=sampling, seed=args.seed, eos_token_ids=eos,
                       progress=not args.no_progress)
    except RuntimeError as e:  # e.g. --impl fused without the fused op
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, toks in enumerate(res.tokens):
        shown = tokenizer.decode(toks) if tokenizer is not None else " ".join(map(str, toks))
        label = "text" if tokenizer is not None else "token ids"
        print(f"[{i}] prompt {res.prompt_lengths[i]} tokens; {label}: {shown}")
    dev = jax.devices()[0]
    print(f"model {args.model} ({cfg.architecture}, {jnp.dtype(model.dtype).name}) "
          f"on {dev.platform}:{dev.device_kind}, impl={args.impl}, batch {batch}")
    print(f"compile time:          {res.compile_s * 1e3:10.1f} ms")
    print(f"prefill time:          {res.prefill_s * 1e3:10.2f} ms")
    print(f"time per output token: {res.time_per_token_s * 1e3:10.3f} ms  ({res.decode_steps} decode steps)")
    print(f"tokens/s:              {res.tokens_per_s:10.1f}  (decode, all rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
