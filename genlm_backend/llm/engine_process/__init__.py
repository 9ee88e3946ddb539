"""Engines in a process of their own: :class:`ProcessEngine`."""

from .process_engine import ProcessEngine

__all__ = ["ProcessEngine"]
