"""A model the cluster is starting (`tetrictl up` names its workers' model: the daemon's `--expect-model`):
until an instance of it registers, a request for it gets 503 with Retry-After, which a client retries,
never 404, which it does not; a model nobody starts is still 404."""

from __future__ import annotations

from pathlib import Path

import httpx

from .harness import start_cluster, wait_for


def test_a_model_still_starting_is_503_with_retry_after_then_served(tmp_path: Path):
    c = start_cluster(tmp_path, [], mode="colocated", daemon_args=["--expect-model", "tetri-sim"])
    try:
        body = {"model": "tetri-sim", "prompt": "hello", "max_tokens": 2}
        r = httpx.post(c.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert r.json()["error"]["param"] == "model" and "starting" in r.json()["error"]["message"]
        other = httpx.post(c.url + "/v1/completions", json=body | {"model": "gpt-nope"}, timeout=10)
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        c.add_worker("colocated")
        served = httpx.post(c.url + "/v1/completions", json=body, timeout=30)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 2
    finally:
        c.stop()


def test_up_tells_the_daemon_which_model_it_starts(tmp_path: Path):
    from .harness import stop_up, tetrictl_up

    args = ["--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path), "--profile", "tiny"]
    p, doc = tetrictl_up([*args, "--time-scale", "50", "--mode", "colocated", "--colocated", "1"])
    try:
        lines = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in _children(p.pid)]
        daemon = next(line for line in lines if b"daemon.main" in line)
        assert daemon[daemon.index(b"--expect-model") + 1] == b"tetri-sim"
        wait_for(lambda: httpx.get(doc["url"] + "/v1/models", timeout=5).json()["data"] != [])
    finally:
        stop_up(p)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids
