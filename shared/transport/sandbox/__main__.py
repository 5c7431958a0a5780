"""`python -m droidmesh.shared.transport.sandbox nixl|ucx FD`: one sandbox process (`child.py`)."""

import sys

from droidmesh.shared.transport.sandbox.child import main

sys.exit(main(sys.argv[1:]))
