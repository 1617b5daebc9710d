"""The wire format: tetri.proto and its committed generated code (see generate.py)."""

from . import tetri_pb2 as pb
from . import tetri_pb2_grpc as rpc

__all__ = ["pb", "rpc"]
