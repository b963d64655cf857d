"""Runtime: what runs on a peer's device.

- ``device_profile.py``: measured matmul FLOP/s and memory of this peer's device, cached.
- ``executor.py``: the framework-neutral Executor interface (OpData in, OpData out, step, state).
- ``torch_executor.py``: the PyTorch executor: a stage's segments with real autograd.
- ``tensor_wire.py``: tensors as OpData bodies (dense or Top-K).
- ``service.py``: the exec protocol that feeds an executor over frame streams.
- ``driver.py``: the data owner's PipelineDriver: sets a job up and drives iterations.
"""

from fusionp2p.runtime.device_profile import DeviceProfile, measure_device, profile_device

__all__ = ["DeviceProfile", "measure_device", "profile_device"]
