"""Fault drills against a running job: inject a fault, measure the recovery from the outside.

A drill strikes a run started with ``infractl train --detach`` and then watches only what an
operator could watch: the nodes' processes and the run's objects in the store (see
``recovery`` for how each number is taken). Every drill is recorded as a ``DrillRecord`` in
``runs/<run>/drills/<drill-id>.json``.

Rooms: ``kind`` (what a fault kind is, and the registry), ``kinds/`` (one file per kind),
``recovery`` (measuring what was watched), ``run`` (one drill: strike, the drill loop that
watches, record), ``series`` (``--repeat N``), ``chaos`` (a seeded series of random kinds, nodes
and moments) and ``compare`` (its run against an uninterrupted reference run). Adding a kind is
one new file in ``kinds/``, its own command-line options included (``Kind.options``); a chaos
series draws it from then on.
"""

from __future__ import annotations

from infractl.drill import kinds as _kinds  # noqa: F401 - registers every kind
from infractl.drill.kind import KINDS, Kind, KindOption, kind_named
from infractl.drill.run import run_drill
from infractl.drill.series import Series, run_series

__all__ = ["KINDS", "Kind", "KindOption", "Series", "kind_named", "run_drill", "run_series"]
