"""The bench model's measured capacity on this machine's CPU: the calibration file the simulator
reads (`python -m bench calibrate` writes it; tandem.planning.capacity reads it)."""

from __future__ import annotations

from pathlib import Path

from tandem.planning.capacity import Capacity

CALIBRATION = Path(__file__).with_name("capacity_cpu.json")


def cpu_capacity(**overrides) -> Capacity:
    """One replica of the bench model as measured here, with any field overridden (e.g. startup_s)."""
    return Capacity.from_calibration(CALIBRATION, **overrides)
