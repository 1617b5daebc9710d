"""The model name a worker's clients send: one rule for the worker (what it registers) and `tetrictl up`
(what it tells the daemon it is starting). Light: no pydantic, nothing heavy."""

from __future__ import annotations

from pathlib import Path

SIM_MODEL_NAME = "tetri-sim"  # what a sim engine's clients send without served_model_name


def served_name(engine: str, model: str | None, served_model_name: str | None) -> str:
    """The model name a worker's clients send: `served_model_name`, else the model directory's name (vllm)
    or `SIM_MODEL_NAME` (sim)."""
    if served_model_name:
        return served_model_name
    return SIM_MODEL_NAME if engine == "sim" else Path(model or ".").resolve().name
