"""How a replicated job's replicas are named on the wire: their plans and setups."""

from __future__ import annotations

__all__ = ["in_job", "replica_job"]


def replica_job(group: str, replica: int, replicas: int) -> str:
    """The job id replica ``replica`` of ``replicas`` of job ``group`` runs (and its plan is
    published) under: ``group`` itself for a job of one replica, else ``<group>-r<replica>``."""
    return group if replicas == 1 else f"{group}-r{replica}"


def in_job(job_id: str, job: str) -> bool:
    """Whether ``job_id`` is ``job`` or one of its replicas' ids (``replica_job``)."""
    return job_id == job or (job_id.startswith(f"{job}-r") and job_id[len(job) + 2 :].isdigit())
