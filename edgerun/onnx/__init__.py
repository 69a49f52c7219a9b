"""ONNX: the directory contract (layout), weight conversion to MatMulNBits, the graph builder, the exporter."""
