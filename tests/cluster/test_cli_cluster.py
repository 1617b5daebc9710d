"""`tetrictl daemon start` and `tetrictl worker start` spread a cluster over processes (hosts); API keys
guard the OpenAI endpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from daemon.db.store import Store, make_engine
from tetrictl.procs import spawn, stop_all, wait_ready

from .harness import start_cluster

pytestmark = pytest.mark.slow


def test_daemon_and_workers_started_separately(tmp_path: Path):
    cfg = tmp_path / "tetri.toml"
    cfg.write_text(
        '[daemon]\napi_keys = ["k1"]\nreport_interval_s = 0.05\ntime_scale = 50\n\n'
        '[worker]\nprofile = "tiny"\ntime_scale = 50\n'
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(
            spawn(
                "tetrictl.app",
                [
                    "daemon",
                    "start",
                    "--port",
                    "0",
                    "--grpc-port",
                    "0",
                    "--state-dir",
                    str(tmp_path),
                    "--config",
                    str(cfg),
                ],
            )
        )
        ready = wait_ready(procs[0], "daemon")
        assert ready["time_scale"] == 50  # one cluster clock: the daemon runs the workers' scale
        for role in ("prefill", "decode"):
            procs.append(
                spawn(
                    "tetrictl.app", ["worker", "start", "--role", role, "--daemon", ready["grpc"], "--config", str(cfg)]
                )
            )
            info = wait_ready(procs[-1], role)
            assert info["role"] == role
        with httpx.Client(base_url=ready["url"], timeout=10) as h:
            insts = h.get("/api/v1/instances").json()["instances"]
            assert {i["role"] for i in insts} == {"prefill", "decode"}
            assert all(i["model"] and i["kv_capacity_tokens"] > 0 for i in insts)
            assert h.post("/v1/completions", json={"model": "tetri-sim", "prompt": "x"}).status_code == 401
        ok = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="k1", max_retries=0)
        bad = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="nope", max_retries=0)
        try:
            assert ok.completions.create(model="tetri-sim", prompt="hi", max_tokens=3).usage.completion_tokens == 3
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model="tetri-sim", prompt="hi", max_tokens=3)
        finally:
            ok.close()
            bad.close()
        procs[-1].send_signal(signal.SIGTERM)
        assert procs[-1].wait(timeout=10) == 0
    finally:
        stop_all(procs)


def test_daemon_refuses_public_bind_without_token(tmp_path: Path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tetrictl.app",
            "daemon",
            "start",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--state-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "needs a token" in r.stderr and "Traceback" not in r.stderr


def test_one_worker_process_hosts_several_sim_instances(tmp_path: Path):
    """`workers.main --instances 3`: three instances in one process, each its own port, id and
    registration, each serving (the scale benchmark's way to run 256 instances on two cores)."""
    c = start_cluster(tmp_path, ["prefill"])
    try:
        p, _ = c.add_worker("decode", expect_ready=False, extra=["--instances", "3"])
        c.workers["several"] = p
        with httpx.Client(base_url=c.url, timeout=30) as h:
            deadline = time.monotonic() + 60
            while (
                len(decodes := [i for i in h.get("/api/v1/instances").json()["instances"] if i["role"] == "decode"]) < 3
            ):
                assert time.monotonic() < deadline and p.poll() is None
                time.sleep(0.1)
            assert len({i["address"] for i in decodes}) == 3 and all(i["id"].startswith("worker-") for i in decodes)
            for d in decodes:
                body = {"model": "tetri-sim", "prompt": [1, 2], "max_tokens": 3, "tetri": {"decode_instance": d["id"]}}
                r = h.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        c.stop()


def test_instances_registering_at_once_all_get_load_samples(tmp_path: Path):
    """64 instances register within a moment (one process): each one's load samples reach the status
    tables and none is refused for arriving before the instance's own row (the registration is written in
    a thread, the samples by the batch writer: a sample waits for its row)."""
    with (tmp_path / "daemon.log").open("w") as log:
        c = start_cluster(tmp_path, [], daemon_stderr=log, time_scale=1.0)
    try:
        for role, n in (("prefill", 16), ("decode", 48)):
            p, _ = c.add_worker(role, expect_ready=False, extra=["--instances", str(n)])
            c.workers[role] = p
        with httpx.Client(base_url=c.url, timeout=30) as h:
            deadline = time.monotonic() + 120
            while len(ids := [i["id"] for i in h.get("/api/v1/instances").json()["instances"]]) < 64:
                assert time.monotonic() < deadline and all(p.poll() is None for p in c.workers.values())
                time.sleep(0.1)
            store = Store(make_engine(c.db_url))
            try:
                while {s["instance_id"] for s in store.list_load_samples()} != set(ids):
                    assert time.monotonic() < deadline, "an instance has no load sample"
                    time.sleep(0.2)
            finally:
                store.close()
    finally:
        c.stop()
    assert "skipping" not in (tmp_path / "daemon.log").read_text()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--instances", "2", "--instance-id", "x"], "take their ids and addresses from their ports"),
        (["--instances", "2", "--engine", "vllm", "--model", "/nonexistent"], "only sim engines share a process"),
        (["--instances", "0"], "instances"),
    ],
)
def test_several_instances_refuse_what_cannot_be_shared(extra: list[str], needle: str):
    r = subprocess.run([sys.executable, "-m", "workers.main", "--role", "decode", *extra], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
