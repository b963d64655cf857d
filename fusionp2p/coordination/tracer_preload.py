"""Imported once by the coordinator's fork server (``coordination.trace_budget``): builds each
built-in family's default model under ``FakeTensorMode``, so that transformers' lazy imports
(seconds per family) are done there once, not in every request's child process."""

from __future__ import annotations

import contextlib
import logging

from torch._subclasses.fake_tensor import FakeTensorMode

from fusionp2p.errors import FusionP2PError
from fusionp2p.opdag.families import BUILTIN_FAMILIES

for _family in BUILTIN_FAMILIES:
    with contextlib.suppress(FusionP2PError), FakeTensorMode():
        _family.build(_family.validate({}))
logging.getLogger(__name__).debug("fork server warmed %d families", len(BUILTIN_FAMILIES))
