"""The CPU fast decode path of Gemma 3 and the Llama family (Llama, Mistral, Qwen2; both bundled models), beside
the native kernels (pqcache/native) it calls.

  dtype.py    the weights' and compute's dtype on the machine at hand (float32 / bfloat16), the usable CPUs
  quantize.py int8 rows and int4 groups of the decode weights, and their products (native kernels or torch)
  weights.py  DecodeLinear: a decoder linear whose one-row forwards read quantized copies (q/k/v and gate/up stacked)
  shape.py    LayerShape: how a decoder layer differs from the common pre-norm block (norms, activation, biases)
  layer.py    FastDecodeLayer: a decoder layer's one-token forward in few operators (or three C calls)
  step.py     FastDecodeStep: one row's decode step without the model's forward around the layers
  lmhead.py   ExactArgmaxHead: the LM head's greedy token from int4/int8 stages, exact where it matters
  install.py  install_fast_decode: the layer forwards and the step on a loaded model

Everything here computes what the model computes (bit-identical, or within float rounding where a C kernel sums in
another order: tests/unit/test_decode_layer.py, tests/unit/test_fast.py); pqcache/serving/loading.py installs it.
"""
