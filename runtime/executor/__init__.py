"""Everything that touches tensors: model runner, CUDA graphs, loader, models, sampler, tensor-parallel workers."""
