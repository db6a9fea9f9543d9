"""`jupyter gpushare COMMAND`: the demo, the doctor and the simulator.

Each command has its own help (`jupyter gpushare demo --help`); options a command does not
know are refused with a message, never ignored.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from .server import selection

DESCRIPTION = """\
jupyter-gpushare releases the GPU memory of idle Jupyter kernels without killing them and
restores it on the next cell. These commands try it and check a machine for it."""

EPILOG = """\
run `jupyter gpushare COMMAND --help` for a command's options. examples:
  jupyter gpushare demo                 JupyterLab with the extension (simulated GPUs if none)
  jupyter gpushare doctor               what this machine supports, what the server will use
  jupyter gpushare simulate --quick     how many users fit on a GPU under each sharing policy"""

DEMO_DESCRIPTION = """\
Start JupyterLab with jupyter-gpushare on this machine's GPUs or, where there is none, on a
simulated node of two 16 GiB GPUs (it says which), with a demo notebook open. Idle kernels
are released after --idle-timeout seconds, so you can watch it happen in the GPU share panel.

The demo's files (its notebook; with --hub the Hub's database, cookie secret and the users'
homes) go in --dir, by default gpushare-demo in Jupyter's data directory, never the current
directory. The notebook is written the first time; after that your copy is kept as you left
it (--reset writes a fresh one)."""

DEMO_EPILOG = """\
JupyterLab's own options go after these, as --Class.option=value (for example
--ServerApp.log_level=DEBUG or --GPUShareApp.poll_interval=0.5).
examples:
  jupyter gpushare demo
  jupyter gpushare demo --no-browser --port 8890 --dir /tmp/demo
  jupyter gpushare demo --backend simulated --reset
  jupyter gpushare demo --hub           JupyterHub, three users (needs configurable-http-proxy)"""

#: a traitlets option for JupyterLab: --Class.option or --Class.option=value
JUPYTER_OPTION = re.compile(r"--[A-Za-z_]\w*\.\w+(=.*)?\Z", re.DOTALL)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DEMO_DESCRIPTION
    parser.epilog = DEMO_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--backend", choices=selection.backend_names(), default="auto",
                        help="where GPU numbers come from (default: auto = the real GPUs when "
                             "NVML sees one, else a simulated node)")
    from .demo import default_dir

    parser.add_argument("--dir", default=None,
                        help="where the demo's files go and JupyterLab opens (default: "
                             f"{default_dir()}, in Jupyter's data directory)")
    parser.add_argument("--reset", action="store_true",
                        help="write a fresh demo notebook over the one in --dir")
    parser.add_argument("--idle-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="seconds idle before a kernel is released (default: 120)")
    parser.add_argument("--port", type=int, default=8888, help="JupyterLab's port (default: 8888)")
    parser.add_argument("--ip", default="127.0.0.1",
                        help="address JupyterLab listens on (default: 127.0.0.1)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser")
    parser.add_argument("--hub", action="store_true",
                        help="a local JupyterHub with three users on one shared simulated node "
                             "and the gpushare service (needs jupyterhub and "
                             "configurable-http-proxy)")


def jupyter_options(extra: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Arguments for JupyterLab: --Class.option[=value] (a value may follow as its own
    argument); anything else is refused."""
    out: list[str] = []
    rest = list(extra)
    while rest:
        arg = rest.pop(0)
        if not JUPYTER_OPTION.match(arg):
            parser.error(f"unrecognized argument: {arg} (JupyterLab's options go as "
                         "--Class.option=value)")
        out.append(arg)
        if "=" not in arg and rest and not rest[0].startswith("-"):
            out.append(rest.pop(0))
    return out


def demo(args: argparse.Namespace, lab_args: list[str]) -> int:
    from .demo import NAME, default_dir, lab_config, write_demo

    directory = Path(args.dir).resolve() if args.dir else default_dir()
    print(f"jupyter-gpushare demo: its files are in {directory} (--dir puts them elsewhere)",
          flush=True)
    if args.hub:  # a local JupyterHub of three users on one shared simulated node
        from .demo.hub import run

        return run(directory, args.port, args.idle_timeout)

    if args.backend == "auto":
        import logging

        from .telemetry.nvml import probe

        quiet = logging.getLogger("jupyter_gpushare.cli.probe")
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False  # the line below says it once
        backend, why = selection.resolve_backend("auto", selection.nvml_look(probe(quiet)))
    else:
        backend, why = args.backend, "asked for on the command line"
    simulated = backend == selection.SIMULATED
    print(f"jupyter-gpushare demo: {'a simulated 2-GPU node' if simulated else 'the real GPUs'} ({why})")
    kept = (directory / NAME).exists() and not args.reset
    notebook = write_demo(directory, simulated, overwrite=args.reset)
    if kept:
        print(f"jupyter-gpushare demo: notebook {notebook} (yours, kept as it is; --reset writes "
              "a fresh one)")
    else:
        print(f"jupyter-gpushare demo: notebook {notebook}")
    argv = [
        f"--ServerApp.root_dir={directory}",
        f"--LabApp.default_url=/lab/tree/{notebook.name}",
        f"--GPUShareApp.backend={backend}",
        f"--GPUShareApp.idle_timeout={args.idle_timeout}",
        # the demo shows releases within minutes: it releases idle kernels whether or not
        # the GPU needs the memory (the product's default waits for a need)
        "--GPUShareApp.release_policy=proactive",
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
    os.environ[selection.BACKEND_ENV] = backend
    os.environ["JUPYTER_CONFIG_PATH"] = lab_config(directory)  # the demo's lab defaults
    from jupyterlab.labapp import LabApp

    LabApp.launch_instance(argv=argv + lab_args)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # its options are its own: hand them over untouched
        from .simulate.cli import main as simulate

        return simulate(argv[1:])
    from . import doctor

    parser = argparse.ArgumentParser(prog="jupyter gpushare", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_parser = sub.add_parser(
        "demo", help="JupyterLab with the extension, on the real GPUs or a simulated node")
    add_demo_arguments(demo_parser)
    doctor_parser = sub.add_parser(
        "doctor", help="what this machine supports and which backend and method the server uses")
    doctor.add_arguments(doctor_parser)
    sub.add_parser("simulate", help="compare sharing policies on a simulated node: how many "
                   "users fit (`jupyter gpushare simulate --help`)")
    from .node import daemon as node_daemon

    daemon_parser = sub.add_parser(
        "node-daemon", help="per-GPU restore turns for every server of a shared node (run as root)")
    node_daemon.add_arguments(daemon_parser)
    args, extra = parser.parse_known_args(argv)
    if args.command == "doctor":
        if extra:
            doctor_parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return doctor.run(args, doctor_parser)
    if args.command == "node-daemon":
        if extra:
            daemon_parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return node_daemon.run(args, daemon_parser)
    return demo(args, jupyter_options(extra, demo_parser))


if __name__ == "__main__":
    sys.exit(main())
