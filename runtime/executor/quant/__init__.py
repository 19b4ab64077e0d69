"""Quantized linear layers: one `Linear` module whose parameters, checkpoint loading and product
belong to a `LinearMethod`, one per weight format.

Terms:
* shard — one checkpoint module of a fused layer: q/k/v of `qkv_proj` (shards 0, 1, 2), gate/up
  of `gate_up_proj` (0, 1); an unfused layer has one shard, 0.
* kind — the checkpoint tensor's last name part: `weight`, `bias`, `weight_scale`, `input_scale`,
  `qweight`, `qzeros`, `scales`, `g_idx`, ... The layer's parameter of that name receives it.
* `ParamLayout` — where a parameter's dims run: `output_dim` along output features (cut by the
  fused shards and by column parallelism), `input_dim` along input features (cut by row
  parallelism), `output_pack`/`input_pack` features per stored element on those dims (packed
  ints, or a group size for group-wise scales), `per_shard` for one entry per shard (dim 0: a
  per-tensor scale). From it `Linear.region` computes, for any tensor-parallel rank, which part of
  a checkpoint tensor to read and where it goes.

A method (subclass `LinearMethod`, register it in `methods.py` under its `--quantization` name):
1. `create_weights(layer)`: `layer.add_param(kind, tensor, layout)` for each tensor it keeps;
   `layer.input_size` and `layer.output_sizes` are this rank's sizes (the fused shards' widths).
2. `load(layer, kind, source, shard)`: copy this rank's part of one checkpoint tensor (read with
   `source.read(dim, start, length)`, only the bytes asked for) and return how many elements of
   which parameters it filled: the loader checks every parameter is filled exactly once. The
   default reads `layer.region(kind, shard, ...)`; override it to convert on the way (FP8
   quantizes a plain checkpoint's weights here, one tensor at a time).
3. `process_after_loading(layer)`: once, after every tensor is in (repack for a kernel, merge
   the shards' static scales, keep a de-quantised copy for the CPU path).
4. `apply(layer, x)`: x (T, input_size) in the model's dtype, or the `QuantizedInput` its producer
   made (step 5) -> (T, sum(output_sizes)) in the model's dtype; bias added.
5. Optional fusions with the op before the layer: `normed_input` (RMSNorm, ahead of q/k/v and
   gate/up) and `activated_input` (SiLU x up, ahead of down): the defaults call the plain ops;
   FP8 quantizes the activations inside them.
6. `dequantized_weight(layer)` -> (sum(output_sizes), input_size) float32: the weight the product
   uses, for tests against the source weights and for the CPU path (de-quantised compute).
7. `fill_dummy(layer, generator)` for `--load-format dummy`.
The unquantized method (`unquantized.py`) is the trivial case; `fp8.py` quantizes weights and
activations, `awq.py` and `gptq.py` read integer weights (`int_linear.py`).
"""
