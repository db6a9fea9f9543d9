"""jupyter_events schemas of jupyter-gpushare."""

from pathlib import Path

KERNEL_SCHEMA_ID = "https://events.jupyter.org/jupyter_gpushare/kernel/v1"
KERNEL_SCHEMA_PATH = Path(__file__).parent / "kernel-v1.yaml"
