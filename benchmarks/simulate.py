"""How many GPUs notebook users need, per sharing policy: the trace-driven simulator (issues 11, 19).

The same program as ``jupyter gpushare simulate`` (``jupyter_gpushare/simulate/``): a seeded
discrete-event simulation of GPU machines shared by notebook users, every policy on the same
workload (``exclusive``, ``static``, ``cull``, ``gpushare``, ``gpushare-hub``): the synthetic
default workload and the shipped example replay, or ``--trace FILE`` (docs/trace-format.md).
gpushare runs as the product ships (release_policy ``needs``, the product's placement rule,
restores that move, rebalance); the baselines are named options. The headline: per policy,
the fewest GPUs that serve every user, as a multiple of the compute limit (the peak SM
demand of the cells running at once, in GPUs), and their GPU-hours against reserving GPUs
per session, under the ``driver`` and ``pinned`` transfer models; then users per GPU;
``gpushare-simulate/simulate.json`` and a PNG per policy.

    python benchmarks/simulate.py [--quick] [any option of jupyter gpushare simulate --help]

``--smoke``: one day, no capacity search, no PNGs, figures to a temporary directory: the
whole path in seconds, no figures worth reading.
"""

from __future__ import annotations

import sys
import tempfile

from jupyter_gpushare.simulate.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--smoke" in args:
        args.remove("--smoke")
        with tempfile.TemporaryDirectory(prefix="gpushare-simulate-smoke-") as out:
            sys.exit(main(["--quick", "--days", "1", "--no-capacity", "--no-png", "--out", out, *args]))
    sys.exit(main(args))
