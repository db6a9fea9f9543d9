"""Coordination beyond one server: restore turns across the servers of a machine (lock
files), placement of new kernels by room, and the link to the JupyterHub service."""
