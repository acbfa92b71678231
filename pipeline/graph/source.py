"""What the source model needs before anything judges it."""

from __future__ import annotations

from typing import Any

from . import edit


def sort_nodes(model: Any) -> Any:
    """A copy of ``model`` whose (sub)graph nodes are in topological order.

    Used on a source model before ``onnx.checker`` sees it: exporters such as PyTorch 1.1 wrote
    valid graphs out of order, which onnxruntime runs but the checker refuses. A cycle or a
    name nothing defines is still a ModelError naming the node.
    """

    result = edit.copy_model(model)
    for graph in edit.all_graphs(result.graph):
        edit.sort_graph(graph)
    return result
