"""Engines: the only boundary between Tetri's scheduling and compute (`base.Engine`).

`sim` is a roofline cost model; `vllm` (a later issue) wraps vLLM. Nothing outside an engine module
imports its compute library.
"""
