"""docs/cluster.md's multi-host block, as written, on four hosts: each a Linux network namespace (its own
interfaces and loopback) with a veth on one bridge, and `/etc/netns/<ns>/hosts` naming the hosts A–D
(`ip netns exec` puts it over /etc/hosts, as DNS would on real hosts). The block's `# host X` lines say
which namespace runs the commands under them; `# anywhere` runs in A.

Requests are served across the hosts, a decode instance flips, and the worker on C is killed with
kill -9 and started again with the same command, and serves again. Needs root and iproute2: without them
the test skips with the reason, unless TETRI_REQUIRE_NETNS=1 (CI sets it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tetrictl.procs import wait_ready

pytestmark = pytest.mark.slow
DOC = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"
TOKEN = "netns-test-token-0123456789"


def doc_block() -> dict[str, list[str]]:
    """The commands of the block under "## Spreading over hosts", by host."""
    text = DOC.read_text(encoding="utf-8")
    body = re.search(r"```sh\n(.*?)```", text[text.index("## Spreading over hosts") :], re.S)
    assert body is not None
    hosts: dict[str, list[str]] = {}
    current = ""
    for line in body.group(1).splitlines():
        head = re.match(r"# host ([A-Z])\b|# (anywhere)\b", line)
        if head:
            current = head.group(1) or head.group(2)
        elif line.strip() and not line.startswith("#"):
            hosts.setdefault(current, []).append(line)
    return hosts


class Net:
    """A bridge in the root namespace (its address lets the test reach the hosts) and one namespace per host."""

    def __init__(self, names: list[str]) -> None:
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"tb{tag}"
        self.subnet = f"10.{77 + int(tag[:2], 16) % 100}.{int(tag[2:4], 16)}"
        self.ns = {h: f"tetri-{tag}-{h.lower()}" for h in names}
        self.addr = {h: f"{self.subnet}.{i + 1}" for i, h in enumerate(names)}
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in self.addr.items())
        for i, (h, ns) in enumerate(self.ns.items()):
            self._ip("netns", "add", ns)
            outer, inner = f"tv{tag}{i}", f"tw{tag}{i}"
            self._ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._ip("link", "set", inner, "netns", ns)
            self._ip("link", "set", outer, "master", self.bridge)
            self._ip("link", "set", outer, "up")
            self._ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", inner)
            self._ip("-n", ns, "link", "set", inner, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def close(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def net() -> Iterator[Net]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        if os.environ.get("TETRI_REQUIRE_NETNS") == "1":
            raise RuntimeError("TETRI_REQUIRE_NETNS=1 but this is not root with iproute2 (ip netns)")
        pytest.skip("network namespaces need root and iproute2")
    n = Net(["A", "B", "C", "D"])
    try:
        yield n
    finally:
        n.close()


def test_the_multi_host_example_runs_across_four_hosts(net: Net, tmp_path: Path):
    block = doc_block()
    assert set(block) == {"A", "B", "C", "D", "anywhere"} and all(len(v) == 1 for v in block.values())
    env = dict(os.environ, TOKEN=TOKEN, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("TETRI_URL", None)
    procs: dict[str, subprocess.Popen[str]] = {}

    def start(host: str) -> dict:
        p = subprocess.Popen(
            ["ip", "netns", "exec", net.ns[host], "bash", "-c", "exec " + block[host][0]],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path,
            start_new_session=True,
        )  # fmt: skip
        procs[host] = p
        return wait_ready(p, f"host {host}")

    try:
        daemon = start("A")
        assert daemon["grpc"].startswith("0.0.0.0:")
        ready = {h: start(h) for h in "BCD"}
        assert ready["C"]["address"] == "C:7000" and ready["C"]["instance_id"] == "worker-C-7000"
        assert ready["B"]["address"] == f"{net.addr['B']}:7000" and ready["D"]["address"] == f"{net.addr['D']}:7000"
        url, auth = f"http://{net.addr['A']}:8000", {"authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, headers=auth, timeout=60) as h:
            # `# anywhere`: the status command, in A (where the name A resolves), as written
            status = subprocess.run(["ip", "netns", "exec", net.ns["A"], "bash", "-c", block["anywhere"][0]],
                                    capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
            assert status.returncode == 0 and "decode 2/2" in status.stdout, status.stdout + status.stderr
            decodes = {ready["C"]["instance_id"], ready["D"]["instance_id"]}
            served = serve(h, 6) + [row for i in decodes for row in serve(h, 3, pin=i)]  # each decode host, too
            assert {r["prefill_instance"] for r in served} == {ready["B"]["instance_id"]}
            assert {r["decode_instance"] for r in served} == decodes

            # a flip: D's decode instance becomes a prefill instance, announced across the hosts
            d = ready["D"]["instance_id"]
            assert h.post(f"/api/v1/instances/{d}/flip", json={"to": "prefill", "reason": "netns"}).status_code == 202
            until(lambda: h.get(f"/api/v1/instances/{d}").json()["role"] == "prefill")
            after = serve(h, 8)
            assert {r["decode_instance"] for r in after} == {ready["C"]["instance_id"]}

            # kill -9 of the worker on C (the only decode instance now), then the same command again
            os.killpg(procs["C"].pid, signal.SIGKILL)
            procs["C"].wait()
            procs["C"].stdout.close()  # type: ignore[union-attr]
            again = start("C")
            assert again["instance_id"] == ready["C"]["instance_id"]  # same host, same id: it takes its place
            until(lambda: h.get(f"/api/v1/instances/{again['instance_id']}").json()["state"] == "active")
            assert {r["decode_instance"] for r in serve(h, 4)} == {again["instance_id"]}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


def serve(h: httpx.Client, n: int, pin: str | None = None) -> list[dict]:
    """n completions (their decode phase on `pin`, if given), then their rows once written."""
    ids = []
    for k in range(n):
        body = {"model": "tetri-sim", "prompt": [7, k + 1], "max_tokens": 4}
        r = h.post("/v1/completions", json=body | ({"tetri": {"decode_instance": pin}} if pin else {}))
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    until(lambda: all(h.get(f"/api/v1/requests/{i}").json()["status"] == "finished" for i in ids))
    return [h.get(f"/api/v1/requests/{i}").json() for i in ids]


def until(pred, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
