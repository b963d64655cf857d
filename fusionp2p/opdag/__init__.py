"""OP-DAG: the model as an operator graph, independent of the framework that runs it.

- ``ir.py``: OpNode and OpDag (pure data: FLOPs, bytes, edges, topological order, cuts).
- ``analytic.py``: the OP-DAG of a transformer family (GPT-2, Llama) computed from its
  config, at block or sub-layer granularity (what ``fusionp2p plan`` uses today).
- ``trace.py``: the op-level OP-DAG of any exportable module (``torch.export``), with
  FLOPs and bytes per aten op, and ``coarsen`` to submodule granularity.
- ``schema.py``: a family's config schema; ``lm_families.py`` (transformers causal LMs)
  and ``vision_families.py`` (ResNets): the built-in families.
- ``families.py``: the ModelRegistry: what a peer builds (built-in families and what its
  operator allowed), each config checked against a schema.
- ``spec.py``: building a ``records.ModelSpec``'s model through a registry.
- ``split.py``: sub-DAG extraction: a normalized assignment cut into segments.

The layers and how they fit: ``docs/architecture.md``.
"""

from fusionp2p.opdag.analytic import TransformerShape, transformer_dag
from fusionp2p.opdag.ir import OpDag, OpNode

__all__ = ["OpDag", "OpNode", "TransformerShape", "transformer_dag"]
