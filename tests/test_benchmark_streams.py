"""benchmarks/common.py's stream timeline (sp_attention_nvshmem.py --trace) and kernel
timeline (decode_e2e.py --trace): the events of every GPU stream line of a profile, in start
order, and their printout; a CPU trace has none."""
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp

def _event(start, dur, name):
    return NS(start_ns=start, duration_ns=dur, name=name)


def test_stream_events_merge_the_gpu_streams_in_start_order(capsys, bench_tool):
    common = bench_tool("common")
    data = NS(planes=[
        NS(name="/host:CPU", lines=[NS(name="Stream #0", events=[_event(0, 5, "host")])]),
        NS(name="/device:GPU:0", lines=[
            NS(name="Stream #7(compute)", events=[_event(1000, 4000, "attention"), _event(9000, 500, "wait")]),
            NS(name="Stream #9(memcpy)", events=[_event(2000, 3000, "MemcpyD2D")]),
            NS(name="XLA Ops", events=[_event(0, 1, "not a stream")])]),
    ])
    events = common.stream_events(data)
    assert [e[3] for e in events] == ["attention", "MemcpyD2D", "wait"]
    assert events[1] == ("GPU:0 Stream #9(memcpy)", 2000, 3000, "MemcpyD2D")
    common.print_stream_events("case", events)
    out = capsys.readouterr().out
    assert "3 activities over 8.5 us" in out
    assert "GPU:0 Stream #7(compute): 2, busy 4.5 us" in out and "GPU:0 Stream #9(memcpy): 1, busy 3.0 us" in out
    assert "t=      1.0 dur=     3.0" in out  # the copy, 1 us after the attention started


def test_print_streams_on_a_cpu_says_there_is_no_gpu_activity(capsys, bench_tool):
    common = bench_tool("common")
    x = jax.device_put(jnp.ones((64, 64)), jax.devices("cpu")[0])  # CPU work even beside a GPU
    f = jax.jit(lambda x: x @ x)
    common.print_streams("cpu", lambda: f(x))
    assert "streams cpu: no GPU activity in the trace" in capsys.readouterr().out


def test_print_timeline_on_a_cpu_says_there_is_no_gpu_activity(capsys, bench_tool):
    """decode_e2e.py --trace on a CPU (its smoke run): a line, not an error."""
    common = bench_tool("common")
    x = jax.device_put(jnp.ones((64, 64)), jax.devices("cpu")[0])
    f = jax.jit(lambda x: x @ x)
    common.print_timeline("cpu", lambda: f(x), calls=1)
    assert "trace cpu: no GPU activity in the trace" in capsys.readouterr().out


def test_layer_spans_split_the_stream_into_its_repeating_layer(capsys, bench_tool):
    """decode_e2e.py --trace's per-layer table: the stream cut before each launch of its most
    frequent kernel; each kernel's span is how far it moved the stream's end, so an overlapped
    (programmatic) kernel counts only past its predecessor and a layer's spans add up to its
    period."""
    common = bench_tool("common")
    events, t = [], 0
    for layer in range(4):
        events += [(t, 10_000, "a"), (t + 8_000, 5_000, "b"), (t + 15_000, 3_000, "c")]  # b overlaps a by 2
        t += 20_000
    events += [(t, 50_000, "lm_head")]  # the step's tail: the last piece is another sequence
    spans = common.layer_spans(events)
    assert spans["names"] == ["a", "b", "c"] and (spans["layers"], spans["pieces"]) == (3, 4)
    # a: 2 us idle before it (past the first layer) + 10; b: 3 past a; c: 2 idle + 3
    assert list(spans["span_us"]) == [12.0, 3.0, 5.0] and list(spans["dur_us"]) == [10.0, 5.0, 3.0]
    assert spans["period_us"] == 20.0
    common.print_layer_spans("case", events)
    out = capsys.readouterr().out
    assert "spans case: 3 of 4 pieces repeat 3 kernels, median period 20.0 us" in out
    assert "     3.0     5.0  b" in out
    assert common.layer_spans([(0, 1, "x"), (5, 1, "y")]) is None  # nothing repeats


def test_layer_spans_cut_whole_layers_when_a_kernel_runs_twice_in_each(bench_tool):
    """A kernel launched twice per layer (a norm before attention and before the MLP) is the
    most frequent one, but cutting there gives halves of two kinds: the cut that covers the
    most launches with one sequence is the layer's."""
    common = bench_tool("common")
    layer = ["norm", "attention", "norm", "mlp"]
    events = [(10_000 * i, 10_000, name) for i, name in enumerate(layer * 5)]
    spans = common.layer_spans(events)
    assert spans["names"] in (layer, layer[1:] + layer[:1], layer[3:] + layer[:3])
    assert spans["layers"] >= 4 and spans["period_us"] == 40.0


def test_layer_spans_prefer_layers_to_whole_steps(bench_tool):
    """A kernel launched once per step (sampling) cuts the stream into steps that repeat and
    cover nearly every launch; the layer repeats far more often and is the one reported."""
    common = bench_tool("common")
    step = ["sample"] + ["attention", "mlp"] * 4
    events = [(10_000 * i, 10_000, name) for i, name in enumerate(step * 3)]
    spans = common.layer_spans(events)
    assert spans["names"] == ["attention", "mlp"] and spans["period_us"] == 20.0
