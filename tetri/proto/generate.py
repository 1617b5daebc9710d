"""Regenerate the committed gRPC code from tetri.proto: ``python -m tetri.proto.generate``.

``--check`` regenerates into a temporary folder and exits 1 if anything differs (a test runs it).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).parent
FILES = ("tetri_pb2.py", "tetri_pb2.pyi", "tetri_pb2_grpc.py")


def generate(out: Path) -> None:
    args = [
        "protoc",
        f"-I{HERE}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(HERE / "tetri.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    grpc_file = out / "tetri_pb2_grpc.py"  # generated code imports its sibling absolutely
    grpc_file.write_text(grpc_file.read_text().replace("import tetri_pb2 as", "from . import tetri_pb2 as"))


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            stale = [f for f in FILES if (Path(tmp) / f).read_text() != (HERE / f).read_text()]
        if stale:
            print(f"stale generated code: {', '.join(stale)} (run python -m tetri.proto.generate)")
            return 1
        return 0
    generate(HERE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
