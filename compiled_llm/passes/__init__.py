"""Inductor FX pattern-matcher fusions, one module per fusion, run by passes/manager.py as Inductor's
post-grad custom pass. Each pattern is the unfused computation as the models write it; the replacement
calls one fused op (compiled_llm/ops)."""
