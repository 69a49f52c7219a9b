"""A model split over several boards with llama.cpp's own RPC backend (ggml-rpc).

rpc.py     the ctypes door to ggml-rpc (inside llama-cpp-python built with -DGGML_RPC=on), endpoints, the
           protocol handshake, lost-worker detection; worker.py `edgerun worker`; status.py `edgerun
           cluster status` (in a child process: a dead worker makes ggml abort); split.py which layers
           land on which device (llama.cpp's own rule) and the cluster's memory-fit check; head.py the
           head's side of edgerun.load(rpc=..., tensor_split=...).
"""
