"""Whether the real trace (``../shared/traces``) is there for the policy tests.

Without it the trace tests skip and the model tests fall back to synthetic
data, which is fine on a laptop.  In CI (``CI=true``) the trace is always
provided, so its absence is a broken checkout, not a reason to test less:
it fails loudly (and "adaptive beats lfuda on the trace" is checked on every landing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from policy_sim import DEFAULT_TRACE  # noqa: E402


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def trace_present() -> bool:
    """True if the trace exists; False off CI; a test failure in CI."""
    if DEFAULT_TRACE.exists():
        return True
    if in_ci():
        pytest.fail(f"CI=true but the trace {DEFAULT_TRACE} is missing: the policy tests would use synthetic data")
    return False


def require_trace() -> None:
    """Skip (off CI) or fail (in CI) a test that needs the trace."""
    if not trace_present():
        pytest.skip(f"{DEFAULT_TRACE} not present")
