"""Runtime: what runs on a peer's device.

- ``device_profile.py``: measured matmul FLOP/s and memory of this peer's device, cached.
"""

from fusionp2p.runtime.device_profile import DeviceProfile, measure_device, profile_device

__all__ = ["DeviceProfile", "measure_device", "profile_device"]
