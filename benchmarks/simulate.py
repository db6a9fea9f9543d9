"""How many notebook users fit per GPU, per sharing policy: the trace-driven simulator (issue 11).

The same program as ``jupyter gpushare simulate`` (``jupyter_gpushare/simulate/``): a seeded
discrete-event simulation of a GPU node shared by notebook users, every policy on the same
workload (``exclusive``, ``static``, ``cull``, ``gpushare``), then the synthetic default
workload and the shipped example replay; tables with ratios against ``exclusive`` from the
same run, ``gpushare-simulate/simulate.json`` and a PNG per policy.

    python benchmarks/simulate.py [--quick] [any option of jupyter gpushare simulate --help]
"""

from __future__ import annotations

import sys

from jupyter_gpushare.simulate.cli import main

if __name__ == "__main__":
    sys.exit(main())
