"""kvpilot's attention and layer kernels: Triton on CUDA, plain-torch reference twins on CPU.

The model runner calls only `kvpilot.kernels.ops`, which picks the implementation by device.
"""
