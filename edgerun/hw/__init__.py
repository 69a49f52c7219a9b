"""Hardware probes: memory bandwidth (native STREAM-like kernels) and the backend cost curve.

Results are cached per device (and per model file) under $EDGERUN_HOME/probes/.
"""
