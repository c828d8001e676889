"""Waiting out a store outage: the delays between retries of an operation that must succeed."""

from __future__ import annotations

__all__ = ["retry_delays"]


def retry_delays(*, first_s: float = 1.0, cap_s: float = 15.0, total_s: float = 600.0) -> list[float]:
    """Seconds to sleep before each retry: doubling from ``first_s``, at most ``cap_s`` each,
    at most ``total_s`` together.

    A fixed schedule rather than a deadline: ranks retrying a collective operation (the final
    checkpoint) in step give up after the same retry, whatever their clocks say.
    """
    delays: list[float] = []
    delay = first_s
    while sum(delays) + delay <= total_s:
        delays.append(delay)
        delay = min(delay * 2, cap_s)
    return delays
