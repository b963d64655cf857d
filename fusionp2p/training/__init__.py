"""The data owner's role: the only place that drives a job.

- ``job_spec.py``: JobSpec, a job's arguments (a TOML file or Python), each checked.
- ``batches.py``, ``data.py``: what a job trains on, by ``[data] kind``: ``corpus.py``
  (byte-level text, the stdlib's source by default), ``images.py`` (scikit-learn's digits).
- ``owner_records.py``: what only a data owner measures: itself, its links.
- ``submit.py``: submitting a job to the coordinator; the plan it publishes, rebuilt here.
- ``verify.py``: the data owner's check of the coordinator: the same plan, from records
  the DHT vouches for.
- ``pipeline.py``: Pipeline, a plan (or a split by hand) set up and driven from here.
- ``supervision.py``: deadlines, stragglers, the checkpoint period, events (pure rules).
- ``checkpoint.py``: checkpoint files; ``outputs.py``: metrics, weights, save_pretrained.
- ``job_run.py``: one run: plans, steps, checkpoints, and recovery from what goes wrong.
- ``trainer.py``: a whole job, from a JobSpec to saved weights, with a progress bar.
- ``data_owner.py``: DataOwner, the role's one entry point (plan, submit, pipeline, train).

The layers and how they fit: ``docs/architecture.md``.
"""
