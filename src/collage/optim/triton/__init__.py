"""Triton kernels for the optimizer step (``docs/gpu.md``): multi-tensor, one pass over
every stored component, every rule under every strategy but plus8 and feedback, capturable.

``layout``: the kernels' table and codes; ``kernels``: the ``@triton.jit`` code, a package
(needs Triton; loaded by ``launch``); ``launch``: tables, arguments and launches; ``path``:
what the dispatch asks (``available``, ``unavailable``) and runs (``step_triton``). collage
imports and works without Triton: then ``path.available`` is False.
"""
