"""Runtime: what runs on a peer's device.

- ``device_profile.py``: measured matmul FLOP/s and memory of this peer's device, cached.
- ``executor.py``: the framework-neutral Executor interface (OpData in, OpData out, step, state).
- ``torch_executor.py``: the PyTorch executor: a stage's segments with real autograd.
- ``stage_state.py``: a stage's tensors and optimizer (only its own, filled by the data owner).
- ``losses.py``: the losses a data owner computes, by name.
- ``opdata_stream.py``: streaming OpData to a peer, windowed by its credit.
- ``tensor_wire.py``: tensors as OpData bodies (dense or Top-K).
- ``memory.py``: what a stage will hold in memory, computed before anything is allocated.
- ``engines.py``: building a stage's executor from a setup (memory check first).
- ``job_setup.py``: JobOptions, and each stage's ``records.JobSetup`` from a layout.
- ``codec.py``: reading an exec message header off a stream, and ExecClient (one
  request stream to a peer).
- ``admission.py``: who may send which exec message, decided before a body is read.
- ``opdata_check.py``: an OpData header checked against the partition.
- ``codec_profile.py``: this device's Top-K coding time; ``throttle.py``: emulated slower devices.
- ``jobs.py``: one job's state on a serving peer and its outgoing OpData streams.
- ``compute.py``: the one compute thread, its bounded queue, and readiness per job.
- ``service.py``: the exec protocol server: who may ask what, and how much.
- ``driver.py``: the data owner's PipelineDriver: sets a job up and drives iterations;
  ``stage_tensors.py``: a stage's tensors in transit (weight chunks, checkpoint parts).

The layers and how they fit: ``docs/architecture.md``.
"""

from fusionp2p.runtime.device_profile import DeviceProfile, measure_device, profile_device

__all__ = ["DeviceProfile", "measure_device", "profile_device"]
