"""Shared pieces of moe-fabric: config, messages, transport, model, routing table, CLI."""

from __future__ import annotations

__version__ = "0.1.0"
