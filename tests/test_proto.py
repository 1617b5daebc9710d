"""The committed generated gRPC code matches tetri.proto."""

import subprocess
import sys


def test_generated_code_is_up_to_date():
    r = subprocess.run([sys.executable, "-m", "tetri.proto.generate", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
