"""`t5r plan`: the real train and KB encode steps compiled for a TPU slice on a CPU-only host.

`chips.py` holds the chips' published constants, `hlo.py` reads collectives out of a compiled
program, `steps.py` builds the steps from abstract parameters and `planner.py` compiles them and
judges the result (memory per device against HBM, the compiler's step-time estimate, replicated
parameters).
"""
