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
    flash_attention_kernel,
    get_kernel,
    merge,
    reference_attention,
    register_kernel,
)
from .planner import Plan, check_shape, plan, sp_attention
from .description import AttnShape, Schedule, Step, Transfer, Work
from .schedules import SCHEDULES, build_schedule, default_degrees, schedule_for
from .topology import Topology, find_topology
from .simulator import GBPS, KernelModel, Links, SimResult, Transport, fit_link, simulate, simulate_schedule
from .volumes import (counted_inter_volume, lemma_f, paper_v_sfu, paper_v_usp, physical_v_sfu,
                      physical_v_usp)
from .flags import NO_OVERLAP_FLAGS, OVERLAP_FLAGS, overlap_flags, set_overlap_flags
