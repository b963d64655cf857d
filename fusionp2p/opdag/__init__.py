"""OP-DAG: the model as an operator graph, independent of the framework that runs it.

- ``ir.py``: OpNode and OpDag (pure data: FLOPs, bytes, edges, topological order, cuts).
- ``analytic.py``: the OP-DAG of a transformer family (GPT-2, Llama) computed from its
  config, at block or sub-layer granularity (what ``fusionp2p plan`` uses today).
- ``trace.py``: the op-level OP-DAG of any exportable module (``torch.export``), with
  FLOPs and bytes per aten op, and ``coarsen`` to submodule granularity.
- ``families.py``: model families and the ModelRegistry: what a peer builds (built-in
  families and what its operator allowed), each config checked against a schema.
- ``spec.py``: ModelSpec, what peers exchange to build the same model (never code).
- ``split.py``: sub-DAG extraction: a normalized assignment cut into segments.
"""

from fusionp2p.opdag.analytic import TransformerShape, transformer_dag
from fusionp2p.opdag.ir import OpDag, OpNode

__all__ = ["OpDag", "OpNode", "TransformerShape", "transformer_dag"]
