"""`jupyter gpushare ...`: demo, doctor and simulate."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .app import BACKEND_ENV


def demo(args: argparse.Namespace, extra: list[str]) -> int:
    from . import doctor
    from .demo import write_demo

    if args.backend == "auto":
        import logging

        from .telemetry.nvml import probe

        quiet = logging.getLogger("jupyter_gpushare.cli.probe")
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False  # the line below says it once
        backend, why = doctor.auto_backend(probe(quiet))
    else:
        backend, why = args.backend, "asked for on the command line"
    simulated = backend == "simulated"
    print(f"jupyter-gpushare demo: {'a simulated 2-GPU node' if simulated else 'the real GPUs'} ({why})")
    directory = Path(args.dir).resolve()
    notebook = write_demo(directory, simulated)
    print(f"jupyter-gpushare demo: notebook {notebook}")
    argv = [
        f"--ServerApp.root_dir={directory}",
        f"--LabApp.default_url=/lab/tree/{notebook.name}",
        f"--GPUShareApp.backend={backend}",
        f"--GPUShareApp.idle_timeout={args.idle_timeout}",
        f"--GPUShareApp.pressure_idle_timeout={min(args.idle_timeout, 30)}",
        "--GPUShareApp.min_release_bytes=0",
        "--GPUShareApp.poll_interval=1",
        f"--ServerApp.port={args.port}",
        f"--ServerApp.ip={args.ip}",
    ]
    if args.no_browser:
        argv.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--allow-root")  # these machines run as root; Jupyter refuses otherwise
    os.environ[BACKEND_ENV] = backend
    from jupyterlab.labapp import LabApp

    LabApp.launch_instance(argv=argv + extra)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # its options are its own: hand them over untouched
        from .simulate.cli import main as simulate

        return simulate(argv[1:])
    parser = argparse.ArgumentParser(prog="jupyter gpushare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="JupyterLab with the extension, on the real GPUs or a simulated node")
    d.add_argument("--backend", choices=["auto", "nvml", "simulated"], default="auto")
    d.add_argument("--dir", default="gpushare-demo", help="where the demo notebook goes (default ./gpushare-demo)")
    d.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds idle before a kernel is released (default 120 for the demo)")
    d.add_argument("--port", type=int, default=8888)
    d.add_argument("--ip", default="127.0.0.1")
    d.add_argument("--no-browser", action="store_true")
    doc = sub.add_parser("doctor", help="what this machine supports and which method will be used")
    doc.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("simulate", help="compare sharing policies on a simulated node: how many users fit")
    args, extra = parser.parse_known_args(argv)
    if args.command == "doctor":
        from . import doctor

        return doctor.main(args.rest)
    return demo(args, extra)


if __name__ == "__main__":
    sys.exit(main())
