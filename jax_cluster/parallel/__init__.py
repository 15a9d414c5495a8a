"""Sequence-parallel DiT attention (StreamFusion): schedules as data, XLA backend, planner,
simulator.

    from jax_cluster import parallel as sp
    p = sp.plan("torus", heads=24, num_machines=2)      # N x M from the devices
    o = sp.sp_attention(q, k, v, p)                      # q, k, v [B, L, H, Dh], seq-sharded
    sp.simulate(machines=4, gpus_per_machine=8, seq_len=65536, heads=24, head_dim=128)
"""
from .layout import Layout, make_layout
from .local_attention import (
    State,
    attend,
    attention,
    empty_state,
    finalize,
    get_kernel,
    merge,
    reference_attention,
    register_kernel,
)
from .planner import Plan, check_shape, plan, sp_attention
from .schedules import SCHEDULES, AttnShape, Schedule, Transfer, Work, build_schedule, schedule_for
from .topology import Topology, find_topology
