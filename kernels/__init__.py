"""CUDA/CuPy kernels, installed as ``fusionp2p.kernels``.

Empty for now: each kernel lands together with its CPU reference in
``fusionp2p/compression`` and a test comparing them on CUDA.
"""
