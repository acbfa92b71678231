"""Graph work on ``onnx.ModelProto``: the transforms, their order, and shape-bucket planning."""
