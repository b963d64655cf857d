"""Coordination: one elected peer plans every job; stages check they follow its plan.

- ``election.py``: the coordinator lease in the DHT, fenced by a growing epoch.
- ``coordinator.py``: the lease holder's work: plan a submitted job, publish the plan.
- ``plan_check.py``: a stage's check that a setup is the coordinator's plan in force.

Imports nothing from ``training/``. The layers and how they fit: ``docs/architecture.md``.
"""
