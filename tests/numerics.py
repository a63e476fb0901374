"""Tolerances shared by the tests that compare one training computation with another."""

# Weights after AdamW steps at lr 1e-3 (tests/unit/test_megatron_backend.py's trainer_spec: each step moves a
# weight by up to ~1e-3), one backend or layout against another: 10% of one step. The two sum the loss in
# another order, and AdamW normalizes each element's step, so an element whose gradient is almost zero turns
# that rounding into a visible difference: up to 4.4e-5 on single elements on a Xeon whose float kernels differ
# from those of the machine an earlier 2e-5 was set on (every other element within 7e-6). A wrong gradient or
# a missed or doubled step moves weights by a whole step and still fails.
ADAMW_WEIGHT_ATOL = 1e-4
