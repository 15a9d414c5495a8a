"""benchmarks/probes/sass_load_chains.py on made-up SASS: a load used before the next load is
issued chains them; loads issued together do not; a loop that uses its loads before its
backward branch waits every iteration."""

def _function(name, lines):
    body = "\n".join(f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(lines))
    return f"\n        Function : {name}\n        .headerflags    @\"EF_CUDA_SM90\"\n{body}\n"


SERIAL = [  # residual loads, each added and stored before the next is issued
    "LDG.E R2, desc[UR4][R4.64]", "FADD R3, R2, R20", "STG.E desc[UR4][R6.64], R3",
    "LDG.E R8, desc[UR4][R10.64]", "FADD R9, R8, R21", "STG.E desc[UR4][R12.64], R9",
    "@P0 LDG.E R14, desc[UR4][R16.64]", "FADD R15, R14, R22", "STG.E desc[UR4][R18.64], R15",
    "LDG.E.64 R24, desc[UR4][R26.64]", "STG.E.64 desc[UR4][R28.64], R24",
    "EXIT",
]
BATCHED = [  # the same loads issued first
    "LDG.E R2, desc[UR4][R4.64]", "LDG.E R8, desc[UR4][R10.64]", "LDG.E R14, desc[UR4][R16.64]",
    "LDG.E.64 R24, desc[UR4][R26.64]", "FADD R3, R2, R20", "FADD R9, R8, R21", "FADD R15, R14, R22",
    "STG.E desc[UR4][R6.64], R3", "STG.E desc[UR4][R12.64], R9", "STG.E.64 desc[UR4][R28.64], R24",
    "EXIT",
]
ASYNC = [  # cp.async copies into shared memory: no register receives data, nothing waits
    "LDGSTS.E.BYPASS.128 [R13+0x4800], desc[UR8][R8.64], P1", "IADD3 R13, R13, 0x10, RZ",
    "LDGSTS.E.BYPASS.128 [R13+0x4800], desc[UR8][R10.64], P1", "IADD3 R13, R13, 0x10, RZ",
    "LDGSTS.E.BYPASS.128 [R13+0x4800], desc[UR8][R12.64], P1", "LDGDEPBAR", "EXIT",
]
LOOP = [  # staging: load, store to shared memory, next iteration
    "MOV R1, c[0x0][0x28]", "LDG.E.128 R4, desc[UR4][R2.64]", "IADD3 R2, R2, 0x1000, RZ",
    "STS.128 [R0], R4", "ISETP.GE.AND P0, PT, R2, R30, PT", "@!P0 BRA 0x10", "EXIT",
]


def test_serial_loads_chain_and_batched_ones_do_not(probe_tool):
    tool = probe_tool("sass_load_chains")
    sass = _function("serial", SERIAL) + _function("batched", BATCHED)
    (n1, serial), (n2, batched) = tool.functions(sass)
    assert (n1, n2) == ("serial", "batched")
    assert tool.longest_chain(serial) == (3, 0x90)  # four loads: three wait for the one before
    assert tool.longest_chain(batched)[0] == 0


def test_async_copies_to_shared_memory_are_not_loads_into_registers(probe_tool):
    tool = probe_tool("sass_load_chains")
    [(_, insts)] = tool.functions(_function("async", ASYNC))
    assert tool.longest_chain(insts)[0] == 0
    assert tool.waiting_loops(insts) == []


def test_a_loop_that_uses_its_load_before_branching_back_waits_every_iteration(probe_tool):
    tool = probe_tool("sass_load_chains")
    [(_, insts)] = tool.functions(_function("staging", LOOP))
    assert tool.waiting_loops(insts) == [(0x10, 0x50, 1, 1)]
    [(_, batched)] = tool.functions(_function("batched", BATCHED))
    assert tool.waiting_loops(batched) == []
