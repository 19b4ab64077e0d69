"""kvpilot's attention and layer kernels: Triton on CUDA, C and plain-torch twins on CPU.

The model runner gets its ops from `kvpilot.kernels.ops.select` (an `interface.Ops`), builds one
`step_plan.StepPlan` per step with `Ops.plan` and passes it to every layer's attention ops.
"""
