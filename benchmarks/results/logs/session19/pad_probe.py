"""Session 19 probe: XLA's attention einsums at an S_max that is not a multiple of 128 (the
model's cache holds ctx + 16 slots): is there a pad copy of the cache, and what does it cost?"""
import re, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import attention_decode as ad

for model, batch in (("llama3-8b", 16), ("llama2-7b", 1)):
    for s_max in (4096, 4112, 4160, 4224):
        consts, fresh, nbytes, shape = ad.make_case(model, jnp.float16, batch, s_max, jax.random.key(0))
        row = []
        for choice in ("jnp", "impl=xla", "auto"):
            step = ad.step_for(choice, shape)
            if choice == "impl=xla" and s_max == 4112:
                txt = jax.jit(lambda c, st: step(st[0], c["w_qkv"], c["w_o"], c["nw"], st[1], st[2], c["lengths"],
                                                 c["inv_freq"])).lower(consts, fresh()).compile().as_text()
                for l in txt.splitlines():
                    if re.search(r" pad\(", l):
                        print("   PAD", l.strip()[:200], flush=True)
            row.append(f"{choice} {ad.time_steps(step, fresh(), consts):8.1f}")
        print(f"{model} b{batch} S_max {s_max}: " + "  ".join(row), flush=True)
