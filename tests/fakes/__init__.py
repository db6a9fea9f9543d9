"""Fakes at the hardware boundary (pynvml, cuda.core.checkpoint), each beside a gpu-marked test.

They reproduce the library's observable behaviour (error classes and values, state machines,
"no new sample" semantics) so the code under test runs unchanged against them.
"""
