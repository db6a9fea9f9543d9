"""The core: a kernel's state machine (:mod:`.lifecycle`) and the rooms of its orchestration.

The controller decides when each step happens; operations, room for a restore, what is said
about an action, host memory and the tracker's readings each have their module. Nothing here
imports the Jupyter server.
"""
