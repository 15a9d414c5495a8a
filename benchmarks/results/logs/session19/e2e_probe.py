"""Session 19 probe: (1) cache-shaped copies in the GPU-compiled decode loop; (2) the kernel
timeline of Llama-3-8B b16 ctx4096 decode steps (where does the non-roofline 3 ms go?)."""
import dataclasses, re, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import decode_e2e as e2e
from common import print_timeline
from flax_models.config import LlamaConfig, RopeConfig
from flax_models.engine import Engine
from flax_models.presets import PRESETS, random_model

def copies(cfg, batch, max_len, impl):
    model = random_model(cfg, jnp.float16)
    eng = Engine(model, impl=impl)
    loop = eng.loop(4)
    cache = model.init_cache(batch, max_len)
    tok = jnp.zeros((batch,), jnp.int32)
    txt = jax.jit(loop, donate_argnums=(2,)).lower(eng.state, tok, cache, jax.random.key(0)).compile().as_text()
    shape = f"[{batch},{cfg.num_kv_heads},{max_len},{cfg.head_dim}]"
    lines = [l.strip()[:220] for l in txt.splitlines() if shape in l and re.search(r" copy(-start)?\(", l)]
    print(f"copies impl={impl}: {len(lines)}", flush=True)
    for l in lines[:6]:
        print("   ", l, flush=True)

small = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=3, num_heads=8,
                    num_kv_heads=2, head_dim=64, rope=RopeConfig(theta=10000.0))
for impl in ("xla", e2e.fused_impl(small) or "auto"):
    copies(small, 2, 1040, impl)

which = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b:16:4096"
name, batch, ctx = which.split(":")
batch, ctx = int(batch), int(ctx)
cfg = PRESETS[name]
model = random_model(cfg, jnp.float16)
for impl in ("xla",):
    eng = Engine(model, impl=impl)
    steps = 4
    loop = eng.loop(steps)
    cache = e2e.random_cache(model, batch, ctx + 16, ctx)
    state = [jnp.zeros((batch,), jnp.int32), cache, jax.random.key(1)]
    del cache
    run = jax.jit(lambda st, t, c, k: loop(st, t, dataclasses.replace(c, lengths=jnp.full_like(c.lengths, ctx)), k),
                  donate_argnums=(2,))
    def call():
        state[:] = run(eng.state, *state)
        return state[0]
    print_timeline(f"{which} {impl}", call, steps, first=0, repeat=2, top=25)
