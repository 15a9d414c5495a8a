"""benchmarks/probes/weight_copies.py on made-up HLO: a copy or transpose fusion that reads a
weight parameter is a per-step copy; a dot fusion reading it, and a copy of an activation,
are not."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HLO = r"""
HloModule jit_step

%fused_computation (p: bf16[512,4096]) -> bf16[16,128,512] {
  ROOT %t = bf16[16,128,512]{2,1,0} transpose(%p), dimensions={1,2,0}
}

ENTRY %main.4 (x.1: bf16[4,2048], w.1: bf16[512,4096]) -> bf16[4,2048] {
  %x.1 = bf16[4,2048]{1,0} parameter(0), metadata={op_name="x"}
  %w__kv_b__.1 = bf16[512,4096]{1,0} parameter(1), metadata={op_name="w[\'kv_b\']"}
  %transpose_copy_fusion.3 = bf16[16,128,512]{2,1,0} fusion(%w__kv_b__.1), kind=kLoop, calls=%fused_computation
  %copy.14 = bf16[4,2048]{0,1} copy(%x.1)
  %dot_fusion = f32[4,4096]{1,0} fusion(%copy.14, %w__kv_b__.1), kind=kCustom, calls=%fused_computation
  ROOT %copy.2 = f32[4,4096]{0,1} copy(%dot_fusion)
}
"""


def _tool():
    spec = importlib.util.spec_from_file_location("_weight_copies", ROOT / "benchmarks" / "probes" / "weight_copies.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_finds_the_weight_copy_only():
    assert _tool().weight_copies(HLO) == [("transpose_copy_fusion.3", "w['kv_b']", 16 * 128 * 512 * 2)]
