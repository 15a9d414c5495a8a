"""jnp references for every op, written from the math with fp32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cluster_reduce(x, op: str = "sum", *, all_blocks: bool = False, repeat: int = 1):
    """[groups, N, size] -> [groups, size] (or every block's copy)."""
    n = x.shape[1]
    xf = x.astype(jnp.float32)
    if op == "sum":
        out = xf.sum(axis=1) * float(n) ** (repeat - 1)
    else:
        out = xf.max(axis=1)
    out = out.astype(x.dtype)
    return jnp.broadcast_to(out[:, None], x.shape) if all_blocks else out


def cluster_gather(x, *, all_blocks: bool = False, repeat: int = 1):
    """[groups, N, size] -> [groups, N * size]; call c of `repeat` gathers x + c."""
    groups, n, size = x.shape
    out = (x.astype(jnp.float32) + (repeat - 1)).astype(x.dtype) if repeat > 1 else x
    out = out.reshape(groups, n * size)
    return jnp.broadcast_to(out[:, None], (groups, n, n * size)) if all_blocks else out


def _rope(v, pos, inv_freq, rotary_dim: int, layout: str):
    """v [..., Dh] fp32 rotated at integer positions pos (broadcast over leading dims)."""
    half = rotary_dim // 2
    angle = pos.astype(jnp.float32)[..., None] * inv_freq  # [..., half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if layout == "half":
        x1, x2 = v[..., :half], v[..., half:rotary_dim]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = v[..., 0:rotary_dim:2], v[..., 1:rotary_dim:2]
        rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        rotated = rotated.reshape(v.shape[:-1] + (rotary_dim,))
    return jnp.concatenate([rotated, v[..., rotary_dim:]], axis=-1)


def _norm_f32(x, norm, weight, bias, eps):
    """x normalised in fp32: "rms", "layer" (with bias) or None (x as fp32)."""
    h = x.astype(jnp.float32)
    if norm == "rms":
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps) * weight.astype(jnp.float32)
    elif norm == "layer":
        mean = h.mean(-1, keepdims=True)
        var = jnp.maximum(jnp.mean(h * h, -1, keepdims=True) - mean * mean, 0.0)
        h = (h - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return h


def append_slots(lengths, max_seq: int, rolling: bool = False):
    """Where a decode step's new token goes: (valid, position, slot, last) per row. The token
    is RoPE'd at `position` (lengths[b]) and written at `slot`, and the attention covers slots
    0..last. A plain cache: slot = last = lengths[b], valid in [0, S_max). A sliding window's
    rolling buffer (slot = position % S_max; once full it holds exactly the window): slot =
    lengths[b] % S_max, last = min(lengths[b], S_max - 1), any lengths[b] >= 0 valid. Invalid
    rows: position 0, last -1."""
    valid = (lengths >= 0) if rolling else (lengths >= 0) & (lengths < max_seq)
    pos = jnp.where(valid, lengths, 0)
    slot = pos % max_seq if rolling else pos
    last = jnp.where(valid, jnp.minimum(pos, max_seq - 1), -1)
    return valid, pos, slot, last


def decode_attention(q, k_cache, v_cache, lengths):
    """out [B, Hkv, G, Dh] = softmax(q . K[..., 0..lengths[b], :]) V (q already scaled), fp32
    math; NaN for rows whose lengths are outside [0, S_max)."""
    f32 = jnp.float32
    s = jnp.einsum("bhgd,bhsd->bhgs", q.astype(f32), k_cache.astype(f32), precision="highest")
    s = jnp.where(jnp.arange(k_cache.shape[2]) <= lengths[:, None, None, None], s, -jnp.inf)
    out = jnp.einsum("bhgs,bhsd->bhgd", jax.nn.softmax(s, axis=-1), v_cache.astype(f32),
                     precision="highest")
    valid = (lengths >= 0) & (lengths < k_cache.shape[2])
    return jnp.where(valid[:, None, None, None], out, jnp.nan).astype(q.dtype)


def decode_attention_append(qkv, k_cache, v_cache, lengths, inv_freq, *, num_q_heads, scale,
                            rotary_dim=None, rope_layout="half", rolling=False):
    """decode_attention for a step's new token (fp32 math): RoPE on q and k of qkv [B,
    (Hq + 2 Hkv) Dh] at position lengths[b], k and v written at slot lengths[b], attention
    over slots 0..lengths[b] (rolling: a sliding window's rolling buffer, append_slots);
    returns (out [B, Hkv, G, Dh] in the caches' dtype, k_cache, v_cache). Invalid rows
    (lengths outside [0, S_max); rolling: negative) give NaN and leave the caches alone."""
    batch, hkv, max_seq, dh = k_cache.shape
    rotary_dim = dh if rotary_dim is None else rotary_dim
    qkv = qkv.astype(jnp.float32)
    valid, pos, slot, last = append_slots(lengths, max_seq, rolling)
    q = _rope(qkv[:, : num_q_heads * dh].reshape(batch, num_q_heads, dh), pos[:, None], inv_freq,
              rotary_dim, rope_layout)
    k = _rope(qkv[:, num_q_heads * dh:(num_q_heads + hkv) * dh].reshape(batch, hkv, dh), pos[:, None],
              inv_freq, rotary_dim, rope_layout)
    v = qkv[:, (num_q_heads + hkv) * dh:].reshape(batch, hkv, dh)
    new = (jnp.arange(max_seq)[None, :] == slot[:, None]) & valid[:, None]  # [B, S]
    k_cache = jnp.where(new[:, None, :, None], k.astype(k_cache.dtype)[:, :, None], k_cache)
    v_cache = jnp.where(new[:, None, :, None], v.astype(v_cache.dtype)[:, :, None], v_cache)
    q = (q * scale).reshape(batch, hkv, num_q_heads // hkv, dh)
    out = decode_attention(q, k_cache, v_cache, last).astype(k_cache.dtype)
    return out, k_cache, v_cache


def attention_block(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, num_q_heads,
                    num_kv_heads, norm="rms", norm_weight=None, norm_bias=None, eps=1e-6,
                    qkv_bias=None, o_bias=None, residual=False, rotary_dim=None,
                    rope_layout="half", scale=None, rolling=False):
    """One decode step of an attention block (fp32 math); returns (y, k_cache, v_cache).

    rolling: the caches are a sliding window's rolling buffer (append_slots). Invalid rows
    (lengths outside [0, S_max); rolling: negative) produce NaN and leave the caches alone."""
    batch, hidden = x.shape
    _, hkv, max_seq, dh = k_cache.shape
    rotary_dim = dh if rotary_dim is None else rotary_dim
    scale = 1.0 / (dh ** 0.5) if scale is None else scale
    group = num_q_heads // num_kv_heads
    h = _norm_f32(x, norm, norm_weight, norm_bias, eps)
    qkv = jnp.dot(h, w_qkv.astype(jnp.float32), precision="highest")
    if qkv_bias is not None:
        qkv = qkv + qkv_bias.astype(jnp.float32)
    q = qkv[:, : num_q_heads * dh].reshape(batch, num_q_heads, dh)
    k = qkv[:, num_q_heads * dh : (num_q_heads + num_kv_heads) * dh].reshape(batch, num_kv_heads, dh)
    v = qkv[:, (num_q_heads + num_kv_heads) * dh :].reshape(batch, num_kv_heads, dh)
    valid, pos, slot, last = append_slots(lengths, max_seq, rolling)
    q = _rope(q, pos[:, None], inv_freq, rotary_dim, rope_layout)
    k = _rope(k, pos[:, None], inv_freq, rotary_dim, rope_layout)
    new = (jnp.arange(max_seq)[None, :] == slot[:, None]) & valid[:, None]  # [B, S]
    k_cache = jnp.where(new[:, None, :, None], k.astype(k_cache.dtype)[:, :, None], k_cache)
    v_cache = jnp.where(new[:, None, :, None], v.astype(v_cache.dtype)[:, :, None], v_cache)
    kf = jnp.repeat(k_cache.astype(jnp.float32), group, axis=1)  # [B, Hq, S, Dh]
    vf = jnp.repeat(v_cache.astype(jnp.float32), group, axis=1)
    s = jnp.einsum("bhd,bhsd->bhs", q, kf, precision="highest") * scale
    s = jnp.where((jnp.arange(max_seq)[None, :] <= last[:, None])[:, None], s, -jnp.inf)
    o = jnp.einsum("bhs,bhsd->bhd", jax.nn.softmax(s, axis=-1), vf, precision="highest")
    y = jnp.dot(o.reshape(batch, -1), w_o.astype(jnp.float32), precision="highest")
    if o_bias is not None:
        y = y + o_bias.astype(jnp.float32)
    if residual:
        y = y + x.astype(jnp.float32)
    y = jnp.where(valid[:, None], y, jnp.nan)
    return y.astype(x.dtype), k_cache, v_cache


def linear(a, w, residual=None, out_dtype=None):
    """y = a @ w (+ residual): a [..., K], w [K, N], residual [..., N]; fp32 accumulation
    (highest precision), the residual added in fp32, one rounding to out_dtype (a's dtype
    when None)."""
    y = jnp.matmul(a.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(a.dtype if out_dtype is None else out_dtype)


def swiglu(x, w_gate, w_up, w_down=None, residual=None):
    """SwiGLU MLP: (silu(x @ w_gate) * (x @ w_up)) @ w_down (+ residual).

    x [..., D], w_gate / w_up [D, F], w_down [F, D] or None (then the activation A2
    [..., F] is returned). Both GEMMs accumulate in fp32 (highest precision); A2 is
    rounded to x.dtype, as every implementation stores it or feeds it to a 16-bit GEMM;
    the output is rounded once, after the residual is added in fp32.
    """
    hi = jax.lax.Precision.HIGHEST
    xf = x.astype(jnp.float32)
    g = jnp.matmul(xf, w_gate.astype(jnp.float32), precision=hi)
    u = jnp.matmul(xf, w_up.astype(jnp.float32), precision=hi)
    a2 = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)
    if w_down is None:
        return a2
    y = jnp.matmul(a2.astype(jnp.float32), w_down.astype(jnp.float32), precision=hi)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(x.dtype)


def flash_attention(q_chunks, kv_chunks, states=None, *, scale=None, finalize=False):
    """Non-causal attention of every query chunk over the keys of EVERY (k, v) chunk, merged
    into each chunk's incoming state (dense, fp32, scores materialised).

    q_chunks [B, Lq_i, H, Dh] each; kv_chunks (k, v) [B, Lk_j, H, Dh] each (lengths may be 0);
    states None or one entry per query chunk: None (empty) or (o fp32 [B, Lq_i, H, Dh]
    normalized, lse fp32 [B, H, Lq_i] natural log; lse = -inf marks an empty row, its o unused).
    Returns a list with, per query chunk, (o, lse): o the softmax-weighted mean of V over every
    key seen (incoming state included), fp32, 0 where nothing was seen; lse the log-sum-exp of
    the scaled scores, -inf where nothing was seen. finalize=True: o alone, in q's dtype.
    """
    hi = jax.lax.Precision.HIGHEST
    states = [None] * len(q_chunks) if states is None else list(states)
    keys = [(k, v) for k, v in kv_chunks if k.shape[1]]
    out = []
    for q, st in zip(q_chunks, states):
        b, lq, h, d = q.shape
        sc = 1.0 / d ** 0.5 if scale is None else scale
        if keys:
            k = jnp.concatenate([k for k, _ in keys], 1).astype(jnp.float32)
            v = jnp.concatenate([v for _, v in keys], 1).astype(jnp.float32)
            s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision=hi) * sc
            lse_new = jax.nn.logsumexp(s, axis=-1)  # [B, H, Lq]
            p = jnp.exp(s - lse_new[..., None])
            o_new = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=hi)
        else:
            lse_new = jnp.full((b, h, lq), -jnp.inf, jnp.float32)
            o_new = jnp.zeros((b, lq, h, d), jnp.float32)
        if st is None:
            o, lse = o_new, lse_new
        else:
            o_old, lse_old = st[0].astype(jnp.float32), st[1].astype(jnp.float32)
            empty_old = ~(lse_old > -jnp.inf)  # -inf (or NaN): nothing seen
            lse_old = jnp.where(empty_old, -jnp.inf, lse_old)
            lse = jnp.logaddexp(lse_old, lse_new)
            both = empty_old & jnp.isneginf(lse_new)
            diff = jnp.where(both, 0.0, lse_old - lse_new)  # weights sigmoid(+-diff) in [0, 1]
            w_old = jnp.transpose(jax.nn.sigmoid(diff), (0, 2, 1))[..., None]
            w_new = jnp.transpose(jax.nn.sigmoid(-diff), (0, 2, 1))[..., None]
            o_old = jnp.where(jnp.transpose(empty_old, (0, 2, 1))[..., None], 0.0, o_old)
            o = w_old * o_old + w_new * o_new
        if finalize:
            seen = jnp.transpose(jnp.isfinite(lse), (0, 2, 1))[..., None]
            out.append(jnp.where(seen, o, 0.0).astype(q.dtype))
        else:
            out.append((o, lse))
    return out


def mla_decode(x, weights, latent_cache, lengths, inv_freq, *, num_heads, kv_lora_rank, qk_nope_head_dim,
               qk_rope_head_dim, v_head_dim, scale, eps, latent_eps=1e-6, rope_factor=1.0, residual=False,
               block_table=None):
    """DeepSeek-V2's absorbed-MLA decode step (fp32 math); returns (y in x.dtype, latent_cache).

    x [B, hidden]; weights: norm (input RMSNorm), q [hidden, H (dn + dr)] or q_a, q_a_norm
    (RMSNorm, latent_eps), q_b; kv_a [hidden, r + dr], kv_a_norm, kv_b [r, H (dn + dv)] (per head
    [W_uk | W_uv]), o [H dv, hidden]; optional q_a_bias, kv_a_bias, o_bias. A cached token is
    c = RMSNorm(h W_kv_a[:, :r]) followed by its interleaved-RoPE key k_rope (E = r + dr features).
    The new token (RoPE at position lengths[b] on q_rope and k_rope, cos and sin times
    rope_factor: YaRN's attention factor) is written at slot lengths[b],
    rounded to the cache dtype, and attends slots 0..lengths[b]:
    score_h(s) = scale ((q_nope_h W_uk_h^T) . c_s + q_rope_h . k_rope_s) (scale includes YaRN's
    mscale), out_h = (sum_s p_h(s) c_s) W_uv_h, y = out W_o (+ o_bias) (+ x when residual).

    latent_cache: [B, S_max, E], or with block_table [B, max_blocks] int32 a page pool
    [num_pages, page_size, E] where slot s of row b is page block_table[b, s // page_size], offset
    s % page_size. A row whose lengths[b] lies outside [0, capacity) (S_max, or max_blocks *
    page_size), or whose used blocks name a page outside the pool, gives NaN and writes nothing.
    """
    f32 = jnp.float32
    w = {k: None if v is None else jnp.asarray(v, f32) for k, v in weights.items()}
    hq, r, dn, dr, dv = num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    batch = x.shape[0]

    def lin(a, name, bias=None):
        y = jnp.dot(a, w[name], precision="highest")
        return y if w.get(bias) is None else y + w[bias]

    if block_table is None:
        capacity = latent_cache.shape[1]
    else:
        num_pages, page, _ = latent_cache.shape
        capacity = block_table.shape[1] * page
    valid = (lengths >= 0) & (lengths < capacity)
    if block_table is not None:  # every block the row reads must name a page of the pool
        used = jnp.arange(block_table.shape[1])[None, :] <= jnp.where(valid, lengths, 0)[:, None] // page
        valid &= jnp.all(~used | ((block_table >= 0) & (block_table < num_pages)), axis=1)
    pos = jnp.where(valid, lengths, 0)

    h = _norm_f32(x, "rms", w["norm"], None, eps)
    if w.get("q") is not None:
        q = lin(h, "q")
    else:
        q = lin(_norm_f32(lin(h, "q_a", "q_a_bias"), "rms", w["q_a_norm"], None, latent_eps), "q_b")
    q = q.reshape(batch, hq, dn + dr)
    kv = lin(h, "kv_a", "kv_a_bias")
    c = _norm_f32(kv[:, :r], "rms", w["kv_a_norm"], None, latent_eps)
    k_rope = _rope(kv[:, r:], pos, inv_freq, dr, "interleaved") * rope_factor  # RoPE is linear
    q_rope = _rope(q[..., dn:], pos[:, None], inv_freq, dr, "interleaved") * rope_factor
    new = jnp.concatenate([c, k_rope], -1).astype(latent_cache.dtype)  # [B, E]

    if block_table is None:
        at_pos = (jnp.arange(capacity)[None, :] == pos[:, None]) & valid[:, None]
        latent_cache = jnp.where(at_pos[..., None], new[:, None], latent_cache)
        lat = latent_cache
    else:
        page_id = jnp.take_along_axis(block_table, (pos // page)[:, None], axis=1)[:, 0]
        page_id = jnp.where(valid, page_id, num_pages)  # out of bounds: dropped
        latent_cache = latent_cache.at[page_id, pos % page].set(new, mode="drop")
        lat = latent_cache[jnp.clip(block_table, 0, num_pages - 1)].reshape(batch, capacity, -1)
    seen = jnp.arange(capacity)[None, :] <= pos[:, None]  # [B, S]
    lat = jnp.where(seen[..., None], lat.astype(f32), 0.0)  # slots past the token never reach the sums

    w_kvb = w["kv_b"].reshape(r, hq, dn + dv)
    q_lat = jnp.einsum("bhd,rhd->bhr", q[..., :dn], w_kvb[..., :dn], precision="highest")
    s = (jnp.einsum("bhr,bsr->bhs", q_lat, lat[..., :r], precision="highest")
         + jnp.einsum("bhd,bsd->bhs", q_rope, lat[..., r:], precision="highest")) * scale
    p = jax.nn.softmax(jnp.where(seen[:, None], s, -jnp.inf), axis=-1)
    o_lat = jnp.einsum("bhs,bsr->bhr", p, lat[..., :r], precision="highest")
    o = jnp.einsum("bhr,rhd->bhd", o_lat, w_kvb[..., dn:], precision="highest")
    y = lin(o.reshape(batch, hq * dv), "o", "o_bias")
    if residual:
        y = y + x.astype(f32)
    y = jnp.where(valid[:, None], y, jnp.nan)
    return y.astype(x.dtype), latent_cache


def moe_route(x, router, *, top_k: int, topk_method: str = "greedy", n_group=None, topk_group=None,
              norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0, score_bias=None):
    """DeepSeek-V2's and V3's routers: x [N, H], router [H, E] -> (weights float32 [N, k], ids int32 [N, k]).

    logits = x @ router in fp32 (Precision.HIGHEST).

    greedy / group_limited_greedy (V2): scores = softmax(logits); group_limited_greedy first
    keeps the topk_group groups (of E / n_group experts) with the highest best score (the
    others' scores become 0). The top_k scores are renormalised to sum 1 when norm_topk_prob
    (and top_k > 1), otherwise multiplied by routed_scaling_factor.

    noaux_tc (V3): scores = sigmoid(logits); the experts are chosen by scores + score_bias [E]
    (the load-balancing correction; None: zeros) within the topk_group groups whose two best
    biased scores sum highest; the weights are the chosen experts' unbiased scores,
    renormalised when norm_topk_prob, then scaled by routed_scaling_factor.

    Every impl of moe_decode routes to this contract; flax_models' route() writes the same jnp.
    """
    logits = jnp.matmul(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    n, e = logits.shape
    if topk_method == "noaux_tc":
        scores = jax.nn.sigmoid(logits)
        choice = scores + (0.0 if score_bias is None else jnp.asarray(score_bias, jnp.float32))
        group_best2 = jax.lax.top_k(choice.reshape(n, n_group, e // n_group), 2)[0].sum(axis=-1)
        _, groups = jax.lax.top_k(group_best2, topk_group)
        keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, top_k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * routed_scaling_factor, ids.astype(jnp.int32)
    scores = jax.nn.softmax(logits, axis=-1)
    if topk_method == "group_limited_greedy":
        group_best = scores.reshape(n, n_group, e // n_group).max(axis=-1)
        _, groups = jax.lax.top_k(group_best, topk_group)
        keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], groups].set(True)
        scores = jnp.where(jnp.repeat(keep, e // n_group, axis=1), scores, 0.0)
    elif topk_method != "greedy":
        raise ValueError(f"moe_route: unknown topk_method {topk_method!r}")
    weights, ids = jax.lax.top_k(scores, top_k)
    if top_k > 1 and norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    else:
        weights = weights * routed_scaling_factor
    return weights, ids.astype(jnp.int32)


def moe_experts(x, weights, ids, w_gate, w_up, w_down, residual=None):
    """The routed experts: y[n] = sum_s weights[n, s] * SwiGLU_{ids[n, s]}(x[n]) (+ residual).

    x [N, H], weights float32 [N, k], ids int32 [N, k], w_gate / w_up [E, H, I], w_down
    [E, I, H]. fp32 math; h = silu(x W_gate) * (x W_up) rounded to x.dtype (as every
    implementation stores it); y rounded once, after the residual. A row with an id
    outside [0, E) is all NaN.
    """
    hi = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    e = w_gate.shape[0]
    valid = jnp.all((ids >= 0) & (ids < e), axis=-1)
    safe = jnp.clip(ids, 0, e - 1)
    xf = x.astype(f32)
    g = jnp.einsum("nh,nkhi->nki", xf, w_gate[safe].astype(f32), precision=hi)
    u = jnp.einsum("nh,nkhi->nki", xf, w_up[safe].astype(f32), precision=hi)
    h = (g * jax.nn.sigmoid(g) * u).astype(x.dtype).astype(f32)
    y_e = jnp.einsum("nki,nkih->nkh", h, w_down[safe].astype(f32), precision=hi)
    y = jnp.einsum("nkh,nk->nh", y_e, weights.astype(f32), precision=hi)
    if residual is not None:
        y = y + residual.astype(f32)
    return jnp.where(valid[:, None], y, jnp.nan).astype(x.dtype)


def moe_decode(x, router, w_gate, w_up, w_down, *, top_k: int, topk_method: str = "greedy", n_group=None,
               topk_group=None, norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0, shared=None,
               residual=None, score_bias=None):
    """DeepSeek-V2's MoE layer at decode: routed experts (+ residual), then the shared experts.

    x [N, H] (normalised hidden states), router [H, E], w_gate / w_up [E, H, I], w_down
    [E, I, H], shared None or dict(w_gate [H, Is], w_up [H, Is], w_down [Is, H]), residual
    None or [N, H]. routed = moe_experts(x, moe_route(x, ...), residual) in x.dtype; with
    shared experts y = swiglu(x, shared..., residual=routed) (one rounding after their
    sum), as flax_models' MoE composes them.
    """
    weights, ids = moe_route(x, router, top_k=top_k, topk_method=topk_method, n_group=n_group,
                             topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                             routed_scaling_factor=routed_scaling_factor, score_bias=score_bias)
    y = moe_experts(x, weights, ids, w_gate, w_up, w_down, residual)
    if shared is not None:
        y = swiglu(x, shared["w_gate"], shared["w_up"], shared["w_down"], y)
    return y


def decoder_layer(x, weights, k_cache, v_cache, lengths, inv_freq, *, family, num_q_heads, num_kv_heads, eps,
                  rotary_dim=None, rope_layout="half", scale=None, parallel_residual=False,
                  gelu_approximate=False, rolling=False):
    """One decode step of a whole decoder layer in fp32; returns (y in x.dtype, k_cache, v_cache).

    family "llama":    h = x + Attn(RMSNorm(x));  y = h + SwiGLU(RMSNorm(h))
    family "gpt_neox": a = Attn(LayerNorm(x));    y = x + a + MLP(LayerNorm'(x))  (parallel_residual)
                                                  y = h + MLP(LayerNorm'(h)), h = x + a  (sequential)
    with Attn = attention_block's norm-less part (QKV + bias, RoPE on the first rotary_dim
    features, cache write at slot lengths[b], attention over 0..lengths[b], out-proj + bias)
    and MLP = GeLU(h W_in + b_in) W_out + b_out (exact erf, or tanh when gelu_approximate).
    weights: norm, qkv, o, post_norm, and w_gate, w_up, w_down (llama) or w_in, w_out (gpt_neox);
    optional norm_bias, post_norm_bias (LayerNorm), qkv_bias, o_bias, b_in, b_out. Every
    intermediate stays fp32 (the contract of a one-launch layer); only the new cache entries
    and y are rounded. rolling: the caches are a sliding window's rolling buffer (append_slots).
    Invalid rows (lengths outside [0, S_max); rolling: negative) give NaN and leave the caches alone.
    """
    f32 = jnp.float32
    w = {k: None if v is None else jnp.asarray(v, f32) for k, v in weights.items()}
    norm = {"llama": "rms", "gpt_neox": "layer"}.get(family)
    if norm is None:
        raise ValueError(f"decoder_layer: family must be 'llama' or 'gpt_neox', got {family!r}")
    x32 = x.astype(f32)
    a, k_cache, v_cache = attention_block(
        x32, w["qkv"], w["o"], k_cache, v_cache, lengths, inv_freq, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, norm=norm, norm_weight=w["norm"], norm_bias=w.get("norm_bias"), eps=eps,
        qkv_bias=w.get("qkv_bias"), o_bias=w.get("o_bias"), rotary_dim=rotary_dim, rope_layout=rope_layout,
        scale=scale, rolling=rolling)
    h = x32 + a
    mlp_in = x32 if (family == "gpt_neox" and parallel_residual) else h
    hn = _norm_f32(mlp_in, norm, w["post_norm"], w.get("post_norm_bias"), eps)

    def dot(u, name, bias=None):
        y = jnp.dot(u, w[name], precision="highest")
        return y if w.get(bias) is None else y + w[bias]

    if family == "llama":
        m = dot(jax.nn.silu(dot(hn, "w_gate")) * dot(hn, "w_up"), "w_down")
    else:
        m = dot(jax.nn.gelu(dot(hn, "w_in", "b_in"), approximate=gelu_approximate), "w_out", "b_out")
    return (h + m).astype(x.dtype), k_cache, v_cache
