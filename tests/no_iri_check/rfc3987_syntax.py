"""Stands in for rfc3987-syntax in the processes the tests start (tests/conftest.py puts this
folder first on their PYTHONPATH).

Where rfc3987-syntax is installed (jsonschema's ``format-nongpl`` extra, which jupyter-events
asks for), importing jsonschema builds some 25 Earley parsers: 3.5-4.5 s of CPU in every
jupyter server, Hub, service and CLI process the tests start. It only checks the ``iri``
string format, which no schema here uses, and jsonschema leaves that check out when this
module cannot be imported. The product itself runs with whatever is installed.
"""

raise ImportError("not loaded in the tests' processes (see tests/no_iri_check)")
