"""A worker's default id names no role (an instance flips and keeps its id) and is unique per address."""

from __future__ import annotations

import pytest

from workers.main import default_instance_id


@pytest.mark.parametrize(
    ("address", "want"),
    [
        ("127.0.0.1:50213", "worker-50213"),
        ("localhost:7", "worker-7"),
        ("[::1]:9", "worker-9"),
        ("10.0.0.2:50213", "worker-10.0.0.2-50213"),  # two hosts, the same port: two ids
        ("[fe80::1]:9", "worker-fe80--1-9"),
    ],
)
def test_default_instance_id(address: str, want: str) -> None:
    assert default_instance_id(address) == want
