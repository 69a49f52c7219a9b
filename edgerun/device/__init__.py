"""The device: profiles (schema, strict loading), detection, the memory-fit check, and the probes
(memory bandwidth, the backend's cost curve) with their cache under $EDGERUN_HOME/probes/."""
