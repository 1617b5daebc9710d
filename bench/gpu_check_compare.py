"""The Python side of `bench/gpu_check.sh` (docs/vllm.md, "A GPU check"): the model it serves, the waits, the
client and the table. Nothing here is downloaded.

    python bench/gpu_check_compare.py write-model DIR [--layers N ...]   # Llama-3-8B's shape, random bf16 weights
    python bench/gpu_check_compare.py wait-ready FILE PID SECONDS      # a Tetri process's JSON ready line
    python bench/gpu_check_compare.py wait-http URL PID SECONDS        # an OpenAI server's GET /v1/models
    python bench/gpu_check_compare.py run URL MODEL OUT.json [--tetri]  # the requests; raw results as JSON
    python bench/gpu_check_compare.py table --vllm A.json --tetri B.json --profile P.json ... # markdown; exit 1: fail

write-model: Meta-Llama-3-8B's config.json (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336,
vocabulary 128256, context 8192, rope_theta 500000), a byte-level BPE tokenizer of exactly that many ids (the
256 byte symbols, filler tokens, Llama 3's 256 special tokens on top: 128000 <|begin_of_text|>, 128001
<|end_of_text|>) and normal(0, 0.02) weights (RMSNorm weights 1), seeded, written as bfloat16 safetensors
shards (16 GB; generated on the GPU when there is one). Real files rather than vLLM's `load_format=dummy`:
`tetrictl profile` reads the weights' size from the files (the cost model's weight traffic) and loads no
dummy weights, and every engine (vLLM's, Tetri's two, the profile's) then loads the very same weights.

run: the same requests for every system, all token-id prompts, greedy (`temperature` 0), `ignore_eos`, streamed
with `return_token_ids`: two warm-up requests, then 24 prompts one at a time (5–1900 tokens, block edges
among them, 64 tokens each: the token comparison), then 32 requests arriving as a Poisson process at 4/s
(32–1500 prompt tokens, 16–128 output tokens). TTFT is send → the first chunk carrying a token, TPOT (JCT −
TTFT) / (tokens − 1), measured here. Plain vLLM then answers the 24 prompts once more, untimed, with the top
two logprobs at every position (`table` tells a near tie from a real difference with them); with --tetri
the client reads each sequential request's status row instead (`kv_loaded_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import struct
import sys
import time
from pathlib import Path
from typing import Any

# --- the model --------------------------------------------------------------------------------------------
LLAMA3_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256}
N_SPECIAL = 256  # Llama 3's special tokens: the top 256 ids
SEED, STD = 0, 0.02
LAYERS_PER_SHARD = 4


def config(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict[str, Any]:
    """Meta-Llama-3-8B's config.json, as published (with these sizes)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": vocab - N_SPECIAL,
        "eos_token_id": vocab - N_SPECIAL + 1,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": STD,
        "intermediate_size": intermediate,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab,
    }


def write_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of exactly `vocab` ids: every id decodes (the models' random outputs do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    table = {s: i for i, s in enumerate(symbols)}
    while len(table) < vocab - N_SPECIAL:  # filler tokens (printable ASCII: the byte-level symbols are themselves)
        table[f"t{len(table)}"] = len(table)
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    specials += [f"<|reserved_special_token_{k}|>" for k in range(N_SPECIAL - len(specials))]
    tok.add_special_tokens(specials)
    if tok.get_vocab_size() != vocab or tok.token_to_id("<|end_of_text|>") != vocab - N_SPECIAL + 1:
        raise RuntimeError(f"tokenizer came out with {tok.get_vocab_size()} ids, wanted {vocab}")
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")


def shapes(c: dict[str, Any]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The weights of LlamaForCausalLM, in shards: the embedding, LAYERS_PER_SHARD layers each, the head."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[("model.embed_tokens.weight", (v, h))]]
    for first in range(0, c["num_hidden_layers"], LAYERS_PER_SHARD):
        shard: list[tuple[str, tuple[int, ...]]] = []
        for n in range(first, min(first + LAYERS_PER_SHARD, c["num_hidden_layers"])):
            p = f"model.layers.{n}."
            shard += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
            shard += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h))]
            shard += [(p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h))]
            shard += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h))]
            shard += [(p + "mlp.down_proj.weight", (h, i))]
        shards.append(shard)
    shards.append([("model.norm.weight", (h,)), ("lm_head.weight", (v, h))])
    return shards


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], make: Any) -> int:
    """A bfloat16 safetensors file written tensor by tensor (never a whole shard in memory); its data's bytes.
    `make(name, shape)` gives a tensor's raw bytes (any buffer)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors:
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in tensors:
            f.write(make(name, shape))
    return offset


def write_model(out: Path, sizes: dict[str, int]) -> None:
    import torch

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    c = config(**sizes)
    (out / "config.json").write_text(json.dumps(c, indent=2), encoding="utf-8")
    write_tokenizer(out, c["vocab_size"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(SEED)

    def make(name: str, shape: tuple[int, ...]) -> Any:
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).mul_(STD).cpu()
        return t.contiguous().view(torch.int16).numpy().data  # bfloat16's bytes (numpy has no bfloat16)

    shards = shapes(c)
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / name, tensors, make)
        weight_map.update({t: name for t, _ in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1), encoding="utf-8")
    print(f"wrote {out}: {total / 1e9:.2f} GB of bfloat16 weights ({device}) in {time.monotonic() - t0:.0f} s")


# --- waits --------------------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_ready(path: Path, pid: int, seconds: float) -> int:
    """Until the process writes its {"event": "ready"} line to `path` (printed); 1 on its error line, its exit
    or the time running out."""
    deadline = time.monotonic() + seconds
    while True:
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        for line in text.splitlines():
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict) and msg.get("event") == "ready":
                print(json.dumps(msg))
                return 0
            if isinstance(msg, dict) and msg.get("event") == "error":
                print(f"error: {msg.get('error')}", file=sys.stderr)
                return 1
        if not alive(pid):
            print("exited before it was ready", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"not ready within {seconds:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.5)


def wait_http(url: str, pid: int, seconds: float) -> int:
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return 0
        except httpx.HTTPError:
            pass
        if not alive(pid):
            print("exited before it was ready", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"not ready within {seconds:.0f} s", file=sys.stderr)
            return 1
        time.sleep(1)


# --- the requests -------------------------------------------------------------------------------------------
SEQ_LENGTHS = (5, 16, 17, 31, 32, 33, 64, 100, 128, 255, 256, 257, 400, 512, 513, 700, 1000, 1023, 1024, 1025,
               1300, 1536, 1700, 1900)  # fmt: skip
SEQ_TOKENS = 64
POISSON_N, POISSON_RATE = 32, 4.0
REQUEST_TIMEOUT_S = 120.0
TIE = 0.1  # nats: a greedy pick this close to the runner-up may flip with bf16 rounding (table: compare)


def requests(vocab_top: int) -> dict[str, list[dict[str, Any]]]:
    """The same prompts for every system: token ids below the special tokens, seeded."""
    rng = random.Random(SEED)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, vocab_top) for _ in range(n)]

    warm = [{"prompt": prompt(n), "max_tokens": 8, "at": 0.0} for n in (100, 700)]
    seq = [{"prompt": prompt(n), "max_tokens": SEQ_TOKENS, "at": 0.0} for n in SEQ_LENGTHS]
    poisson, t = [], 0.0
    for _ in range(POISSON_N):
        t += rng.expovariate(POISSON_RATE)
        poisson.append({"prompt": prompt(rng.randint(32, 1500)), "max_tokens": rng.randint(16, 128), "at": t})
    return {"warmup": warm, "sequential": seq, "poisson": poisson}


async def one(client: Any, model: str, req: dict[str, Any], rid: str | None, top2: bool = False) -> dict[str, Any]:
    """One streamed request; with `top2` (plain vLLM only) also the two likeliest ids and their logprobs at
    each position."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": req["prompt"],
        "max_tokens": req["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    if rid is not None:
        body["tetri"] = {"request_id": rid}
    if top2:
        body |= {"logprobs": 2, "return_tokens_as_token_ids": True}
    res: dict[str, Any] = {"rid": rid, "prompt_len": len(req["prompt"]), "max_tokens": req["max_tokens"], "ids": []}
    if top2:
        res["top2"] = []
    stamps: list[float] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            buf = b""
            async for chunk in resp.aiter_bytes():  # split on b"\n" only: raw U+2028 inside JSON is no line end
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    msg = json.loads(line[6:])
                    if "error" in msg:
                        raise RuntimeError(f"stream error: {msg['error']}")
                    ids = [t for c in msg.get("choices", []) for t in c.get("token_ids") or []]
                    stamps += [time.perf_counter() - t0] * len(ids)
                    res["ids"] += ids
                    if top2:  # [{"token_id:ID": logprob, …}, …], one per token
                        for c in msg.get("choices", []):
                            for top in (c.get("logprobs") or {}).get("top_logprobs") or []:
                                best = sorted(top.items(), key=lambda kv: -kv[1])
                                res["top2"].append([[int(k.rsplit(":", 1)[1]), float(lp)] for k, lp in best[:2]])
        if len(res["ids"]) != req["max_tokens"]:
            raise RuntimeError(f"asked for {req['max_tokens']} tokens, got {len(res['ids'])}")
    except Exception as e:  # a failed request is a result: counted and listed, never an abort
        res["error"] = f"{type(e).__name__}: {e}"[:300]
        return res
    res |= {"ttft": stamps[0], "t2": stamps[1] if len(stamps) > 1 else stamps[0], "jct": time.perf_counter() - t0}
    return res


async def run(url: str, model: str, tetri: bool, vocab_top: int) -> dict[str, Any]:
    import httpx

    reqs = requests(vocab_top)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=64)) as client:
        for r in reqs["warmup"]:
            await one(client, model, r, None)
        out["sequential"] = [
            await one(client, model, r, f"gc-seq-{k}" if tetri else None) for k, r in enumerate(reqs["sequential"])
        ]
        t0 = time.perf_counter()

        async def at(r: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, r["at"] - (time.perf_counter() - t0)))
            return await one(client, model, r, None)

        out["poisson"] = list(await asyncio.gather(*(at(r) for r in reqs["poisson"])))
        if not tetri:  # untimed: the sequential prompts again, with the top two logprobs at every position
            out["reference"] = [await one(client, model, r, None, top2=True) for r in reqs["sequential"]]
        if tetri:  # the status table's view of each hand-over (rows are written in batches): 10 s for them all
            deadline = time.monotonic() + 10
            for res in out["sequential"]:
                row: dict[str, Any] = {}
                while time.monotonic() < deadline:
                    try:
                        got = await client.get(f"/api/v1/requests/{res['rid']}", timeout=5)
                        row = got.json() if got.status_code == 200 else {}
                    except (httpx.HTTPError, ValueError):
                        row = {}
                    if row.get("status") not in (None, "running"):
                        break
                    await asyncio.sleep(0.2)
                res["kv_loaded_tokens"] = row.get("kv_loaded_tokens")
                res["status"] = row.get("status")
    return out


# --- the table ----------------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    """The q-th percentile, linear between order statistics (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(xs: list[float], a: float = 50, b: float = 99) -> str:
    return f"{1000 * pct(xs, a):.1f} / {1000 * pct(xs, b):.1f}" if xs else "—"


def ok(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rs if "error" not in r]


def ttft(rs: list[dict[str, Any]]) -> list[float]:
    return [r["ttft"] for r in ok(rs)]


def tpot(rs: list[dict[str, Any]]) -> list[float]:
    return [(r["jct"] - r["ttft"]) / (len(r["ids"]) - 1) for r in ok(rs) if len(r["ids"]) > 1]


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    return sum(1 for x, y in zip(a, b, strict=True) if "error" not in x and "error" not in y and x["ids"] == y["ids"])


def compare(t: dict[str, Any], v: dict[str, Any]) -> tuple[int, list[str], list[str]]:
    """The sequential answers: how many are vLLM's token for token; those that part from it at a near tie (the
    first differing token is vLLM's runner-up there, within TIE of its pick: bf16 rounding along another
    kernel path flips such a pick); and the rest (a real difference), each described."""
    same_n, ties, other = 0, [], []
    refs = v.get("reference") or [{} for _ in v["sequential"]]
    for k, (x, y, ref) in enumerate(zip(t["sequential"], v["sequential"], refs, strict=True)):
        what = f"prompt {k} ({x['prompt_len']} tokens)"
        if "error" in x or "error" in y:
            other.append(f"{what}: failed")
            continue
        if x["ids"] == y["ids"]:
            same_n += 1
            continue
        d = next((i for i, (a, b) in enumerate(zip(x["ids"], y["ids"], strict=True)) if a != b), 0)
        top = ref.get("top2") or []
        if ref.get("ids") != y["ids"] or len(top) <= d or len(top[d]) < 2:
            other.append(f"{what}: differs from token {d} (no reference logprobs there)")
            continue
        (_, lp1), (second, lp2) = top[d]
        if x["ids"][d] == second and lp1 - lp2 <= TIE:
            ties.append(f"{what}: token {d}, gap {lp1 - lp2:.4f}")
        else:
            other.append(f"{what}: differs from token {d} (vLLM's top two there: {top[d]})")
    return same_n, ties, other


def load(path: Path | None) -> dict[str, Any] | None:
    """A JSON document from a file, or the first one in it that starts a line (`tetrictl profile --json`'s
    stdout, should anything else be printed there too); None when there is none."""
    if path is None or not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    for start in [0, *(m.start() for m in re.finditer(r"(?m)^\{", text))]:
        try:
            doc, _ = json.JSONDecoder().raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


def table(a: argparse.Namespace) -> int:
    v, t, p = load(a.vllm), load(a.tetri), load(a.profile)
    failed = list(a.failed)
    notes: list[str] = []
    rows: list[tuple[str, str, str]] = []
    tetri = f"Tetri 1P+1D ({a.connector})" if a.connector else "Tetri 1P+1D"
    n_seq = len(SEQ_LENGTHS)
    if p is not None:
        kinds = p.get("heldout_error_by_kind", {})
        by_kind = " / ".join(f"{100 * kinds[k]:.1f}%" for k in ("prefill", "decode", "mixed") if k in kinds)
        rows.append(
            (
                "profile fit error: held out, all (prefill / decode / mixed); on the fit",
                f"{100 * p['heldout_mean_abs_error']:.1f}% ({by_kind}); {100 * p['train_mean_abs_error']:.1f}%",
                "—",
            )
        )
    else:
        rows.append(("profile fit error", "not measured", "—"))
    if v is not None and t is not None:
        n, ties, other = compare(t, v)
        cell = f"**{n} of {n_seq}**" + (f"; {len(ties)} part at a near tie (below)" if ties else "")
        rows.append((f"tokens identical, {n_seq} prompts one at a time (greedy)", cell, "reference"))
        notes += [f"near tie (bf16 rounding, within {TIE:g} nats of vLLM's pick): {x}" for x in ties]
        if other:
            failed.append(f"tokens differ: {len(other)} of {n_seq} sequential prompts")
            notes += [f"differs: {x}" for x in other]
        again = same(v.get("reference") or [{} for _ in v["sequential"]], v["sequential"])
        rows.append(("the same tokens on a second pass (vLLM's reproducibility)", "—", f"{again} of {n_seq}"))
    else:
        rows.append(("tokens identical", "not compared", "not compared"))
        failed.append("tokens not compared: a side did not run")
    sides = (t, v)

    def both(f: Any) -> tuple[str, str]:
        a_, b_ = (f(s) if s is not None else "—" for s in sides)
        return a_, b_

    rows.append(("TTFT p50 / p99, one at a time (ms)", *both(lambda s: ms(ttft(s["sequential"])))))
    rows.append(("TPOT p50 / p99, one at a time (ms)", *both(lambda s: ms(tpot(s["sequential"])))))
    gap = "2nd − 1st token p50 / max, one at a time (ms; 1P+1D: the hand-over)"
    rows.append((gap, *both(lambda s: ms([r["t2"] - r["ttft"] for r in ok(s["sequential"])], 50, 100))))
    pois = f"Poisson {POISSON_RATE:g}/s, {POISSON_N} requests"
    rows.append((f"TTFT p50 / p99, {pois} (ms)", *both(lambda s: ms(ttft(s["poisson"])))))
    rows.append((f"TPOT p50 / p99, {pois} (ms)", *both(lambda s: ms(tpot(s["poisson"])))))
    if v is not None and t is not None:
        n = same(t["poisson"], v["poisson"])
        rows.append(("tokens identical under Poisson load (not checked: batches differ)", f"{n} of {POISSON_N}", "—"))
    errors: list[str] = []
    for name, s in (("Tetri", t), ("vLLM", v)):
        if s is not None:
            bad = [r for phase in ("sequential", "poisson") for r in s[phase] if "error" in r]
            errors += [f"{name}: {r['error']}" for r in bad]
            if bad:
                failed.append(f"{name}: {len(bad)} requests failed")
    rows.append(("failed requests", *both(lambda s: str(sum("error" in r for r in s["sequential"] + s["poisson"])))))
    if t is not None:
        full = sum(1 for r in t["sequential"] if r.get("kv_loaded_tokens") == r["prompt_len"])
        rows.append(("decode's `kv_loaded_tokens` = prompt (status table)", f"{full} of {n_seq}", "—"))
        if a.connector != "HostKVConnector":
            notes.append(
                "kv_loaded_tokens: with NIXL, vLLM (0.32) reports the prefill side's own prefix-cache hits as the "
                "decode request's num_cached_tokens (remote_prefill_cached_tokens), so 0 there is no evidence either "
                "way; a decode engine that computed the prompt itself shows as a 2nd − 1st token gap near vLLM's TTFT"
            )
    print(f"\n### GPU check: {a.gpu}, a Llama-3-8B-shaped model (random bfloat16 weights)\n")
    print(f"| | {tetri} | plain vLLM |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    for note in notes:
        print(f"\n{note}")
    for e in sorted(set(errors))[:10]:
        print(f"\nrequest error: {e}")
    for f in failed:
        print(f"\nFAILED: {f}")
    if not failed:
        print("\nOK: every step ran, no request failed, the sequential answers are vLLM's (but for near ties listed).")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-model")
    w.add_argument("dir", type=Path)
    for key, default in LLAMA3_8B.items():
        w.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=default)
    r = sub.add_parser("wait-ready")
    r.add_argument("file", type=Path)
    r.add_argument("pid", type=int)
    r.add_argument("seconds", type=float)
    h = sub.add_parser("wait-http")
    h.add_argument("url")
    h.add_argument("pid", type=int)
    h.add_argument("seconds", type=float)
    c = sub.add_parser("run")
    c.add_argument("url")
    c.add_argument("model")
    c.add_argument("out", type=Path)
    c.add_argument("--tetri", action="store_true", help="Tetri's daemon: name the requests, read their rows")
    c.add_argument("--vocab", type=int, default=LLAMA3_8B["vocab"])
    t = sub.add_parser("table")
    for name in ("vllm", "tetri", "profile"):
        t.add_argument(f"--{name}", type=Path)
    t.add_argument("--connector", default="")
    t.add_argument("--gpu", default="GPU")
    t.add_argument("--failed", action="append", default=[], help="a step that failed, and why (repeatable)")
    a = ap.parse_args()
    if a.cmd == "write-model":
        write_model(a.dir, {k: getattr(a, k) for k in LLAMA3_8B})
        return 0
    if a.cmd == "wait-ready":
        return wait_ready(a.file, a.pid, a.seconds)
    if a.cmd == "wait-http":
        return wait_http(a.url, a.pid, a.seconds)
    if a.cmd == "run":
        result = asyncio.run(run(a.url, a.model, a.tetri, a.vocab - N_SPECIAL))
        a.out.write_text(json.dumps(result), encoding="utf-8")
        bad = sum("error" in x for phase in result.values() for x in phase)
        print(f"{sum(len(x) for x in result.values())} requests, {bad} failed")
        return 0
    return table(a)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
