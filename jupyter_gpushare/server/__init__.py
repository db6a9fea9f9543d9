"""The Jupyter server's doors: the extension (its options and wiring), REST, the kernel
websocket gate, the agent channel, the provisioner, and the REST contract."""
