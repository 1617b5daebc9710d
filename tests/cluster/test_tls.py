"""TLS for clusters that span hosts: the daemon serves HTTPS and gRPC over TLS, workers serve TLS and
verify the daemon's and each other's certificates (one CA); a request runs end to end, and a client
that does not trust the CA is refused."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .harness import start_cluster

pytestmark = pytest.mark.slow


def self_signed(d: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost that is its own CA (test only)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tetri-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = d / "cert.pem", d / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


def test_a_cluster_over_tls(tmp_path: Path):
    cert, key = self_signed(tmp_path)
    env = {}
    for who in ("DAEMON", "WORKER"):
        env |= {
            f"TETRI_{who}_TLS_CERT_FILE": str(cert),
            f"TETRI_{who}_TLS_KEY_FILE": str(key),
            f"TETRI_{who}_TLS_CA_FILE": str(cert),
        }
    c = start_cluster(tmp_path / "state", ["prefill", "decode"], env=env)
    try:
        assert c.url.startswith("https://")
        body = {"model": "tetri-sim", "prompt": [1, 2, 3], "max_tokens": 6}
        with httpx.Client(base_url=c.url, verify=ssl.create_default_context(cafile=str(cert)), timeout=30) as h:
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
            rid = r.json()["id"]
            deadline = time.monotonic() + 5
            while (row := h.get(f"/api/v1/requests/{rid}")).json().get("status") != "finished":  # batched writes
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert [row.json()["decode_instance"]] == c.started_as("decode")  # it went through the hand-over
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.post(c.url + "/v1/completions", json=body, timeout=10)
        # tetrictl trusts the system's CAs, or the CA file SSL_CERT_FILE names
        ctl = [sys.executable, "-m", "tetrictl.app", "status", "--url", c.url, "--json"]
        trusted = subprocess.run(
            ctl, capture_output=True, text=True, timeout=60, env=os.environ | {"SSL_CERT_FILE": str(cert)}
        )
        assert trusted.returncode == 0 and json.loads(trusted.stdout)["inflight"] == 0, trusted.stderr
        untrusted = subprocess.run(ctl, capture_output=True, text=True, timeout=60)
        assert untrusted.returncode != 0 and "Traceback" not in untrusted.stderr
        assert len(untrusted.stderr.strip().splitlines()) == 1, untrusted.stderr
        missing = subprocess.run(
            ctl,
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ | {"SSL_CERT_FILE": str(tmp_path / "no.pem")},
        )
        assert missing.returncode == 2 and missing.stderr.startswith("error: cannot load the CAs to trust from")
        assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
        # or the CA file `tetrictl --ca-file` (TETRI_CA_FILE, [ctl] ca_file) names
        by_flag = subprocess.run(
            [*ctl[:3], "--ca-file", str(cert), *ctl[3:]], capture_output=True, text=True, timeout=60
        )
        assert by_flag.returncode == 0 and json.loads(by_flag.stdout)["inflight"] == 0, by_flag.stderr
        conf = tmp_path / "ctl.toml"
        conf.write_text(f'[ctl]\nca_file = "{cert}"\n')
        by_conf = subprocess.run([*ctl, "--config", str(conf)], capture_output=True, text=True, timeout=60)
        assert by_conf.returncode == 0, by_conf.stderr
        for bad in (tmp_path / "no.pem", conf):  # missing, and not PEM
            wrong = subprocess.run([*ctl[:3], "--ca-file", str(bad), *ctl[3:]], capture_output=True, text=True)
            assert wrong.returncode == 2 and wrong.stderr.startswith(f"error: --ca-file: cannot load {bad}: ")
            assert len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    finally:
        c.stop()
