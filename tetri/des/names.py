"""The bench's workload names, light to import (the CLI's help lists them)."""

from __future__ import annotations

WORKLOADS = ("LPLD", "LPHD", "HPLD", "HPHD", "Mixed")
