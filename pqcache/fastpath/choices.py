"""The fast path's settings by name, as the command line and the app offer them. No torch here: app.py --ray parses
its flags without loading a model (dtype.py and weights.py give the names their meaning)."""

from __future__ import annotations

DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # `dtype`: auto, or the weights' and compute's torch dtype

DECODE_WEIGHTS = ("int8", "auto", "int4", "model")
# "auto": int4 for the linears whose weights already are 4-bit (every group of 32 on a grid of at most 16 levels:
# the GGUF's Q4_K tensors, o_proj and half of down_proj in the bundled model), whose int4 copy is closer to the
# model's weights than an int8 one (quantize.grid_steps), int8 rows for the others: 1.4 ms a step less at 8K.
# int8 stays the default: on the bundled sample, "What is the pass key?" is decided by 0.075 nats between "6" and "1"
# in the float32 model, and "auto" tips it to "1" where int8 keeps "6" (tests/model/test_real_model.py asks it).
# int4 for every linear reads 2.5x fewer bytes a step but loses half the levels of the 5- and 8-bit tensors, and
# changed the answer outright (tests/model/test_real_model.py; docs/results.md).
DEFAULT_DECODE_WEIGHTS = "int8"
