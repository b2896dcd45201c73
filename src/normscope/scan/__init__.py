"""Scan a live model: every norm site with its contract, role and placement (see docs/scan.md)."""

from __future__ import annotations

from .core import scan
from .dataflow import PLACEMENTS, ROLES
from .result import SCHEMA, ModelScan, Site

__all__ = ["PLACEMENTS", "ROLES", "SCHEMA", "ModelScan", "Site", "scan"]
