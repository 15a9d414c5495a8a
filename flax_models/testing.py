"""Test helpers: conformance against Hugging Face transformers (torch imported lazily), and
torch-free fake checkpoints built from the loader's own tensor map."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import hf_maps
from .config import config_from_hf
from .engine import generate, pad_prompts
from .loading import from_pretrained


# ----------------------------------------------------------------------------- fake checkpoints
def fake_checkpoint(hf_config: dict, path, *, seed: int = 0, std: float = 0.2, drop=(), add=None, reshape=None):
    """Writes config.json + model.safetensors with random tensors under the Hugging Face names our
    loader expects (first alternative of each spec). drop / add / reshape corrupt it for tests."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config_from_hf(hf_config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for spec in hf_maps.specs_for(cfg):
        src = spec.sources[0]
        for name, shape in zip(src.names, src.shapes):
            tensors[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    for name in drop:
        del tensors[name]
    for name, shape in (add or {}).items():
        tensors[name] = np.zeros(shape, np.float32)
    for name, shape in (reshape or {}).items():
        tensors[name] = np.zeros(shape, np.float32)
    (path / "config.json").write_text(json.dumps(hf_config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


# ----------------------------------------------------------------------------- transformers conformance
def hf_roundtrip(hf_config, path, *, seed: int = 0, impl="xla"):
    """(transformers model, our model) for a transformers config: random init, save_pretrained, load."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float().eval()
    hf.save_pretrained(str(path))
    return hf, from_pretrained(path, dtype="fp32", impl=impl)


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def hf_logits(hf, seq) -> np.ndarray:
    import torch  # noqa: PLC0415

    with torch.no_grad():
        return hf(torch.as_tensor(np.asarray(seq, np.int64))[None]).logits[0].float().numpy()


def compare_logits(hf, model, *, prompt_lengths=(5, 11), decode_steps=16, seed=0):
    """Prefill (a right-padded batch of prompts of different lengths) then `decode_steps` cached decode
    steps, teacher-forced with random tokens; each position's logits against transformers' logits
    of the whole unpadded sequence. Returns {"prefill": max rel err, "decode": max rel err, "per_step": [...]}."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab, n + decode_steps) for n in prompt_lengths]
    refs = [hf_logits(hf, s) for s in seqs]
    tokens, lengths = pad_prompts([s[:n] for s, n in zip(seqs, prompt_lengths)], multiple=1)
    b, t = tokens.shape
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens, lengths, cache):
        return nnx.merge(graphdef, state).prefill(tokens, lengths, cache, all_logits=True)

    @jax.jit
    def step(state, tok, cache):
        return nnx.merge(graphdef, state).decode(tok, cache)

    cache = model.init_cache(b, t + decode_steps)
    logits, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    logits = np.asarray(logits)
    pre = max(_rel(logits[i, :n], refs[i][:n]) for i, n in enumerate(prompt_lengths))
    per_step = []
    for j in range(decode_steps):
        tok = jnp.asarray([s[n + j] for s, n in zip(seqs, prompt_lengths)], jnp.int32)
        logits, cache = step(state, tok, cache)
        logits = np.asarray(logits)
        per_step.append(max(_rel(logits[i], refs[i][n + j]) for i, n in enumerate(prompt_lengths)))
    return {"prefill": pre, "decode": max(per_step), "per_step": per_step}


def compare_greedy(hf, model, *, prompt_lengths=(4, 9), new_tokens=16, seed=1):
    """(ours, theirs): greedy continuations of a batch of prompts (ours batched, theirs one by one)."""
    import torch  # noqa: PLC0415

    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, n).tolist() for n in prompt_lengths]
    ours = generate(model, prompts, new_tokens).tokens
    theirs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=0)
        theirs.append(out[0, len(p):].tolist())
    return ours, theirs
