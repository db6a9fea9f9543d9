"""A trace-driven simulator of a shared GPU node: how many notebook users fit, per policy.

Not to be confused with ``jupyter_gpushare.sim`` (the simulated GPU node the server and
kernels run on where there is no GPU): this package runs no server and no kernel. It replays
a workload (generated, or read from an installation's history) on a model of one or more GPU
nodes, once per sharing policy, on a simulated clock, and reports what each policy gives:
the fewest GPUs that serve every user and their GPU-hours against reserving GPUs per session,
users per GPU, cell delays and slowdowns, work lost, allocation against utilization.

The ``gpushare`` policy calls :mod:`jupyter_gpushare.policy` unchanged, with candidates built
the way :mod:`jupyter_gpushare.core.controller` builds them, and places kernels, chooses
restores' GPUs, rebalances and lands servers on machines by
:mod:`jupyter_gpushare.policy.placement` unchanged, with the product's defaults read from its
options (``defaults.py``), so what it predicts is what the product does. Entry points:
``jupyter gpushare simulate`` and ``benchmarks/simulate.py``.
"""
