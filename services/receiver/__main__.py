"""`python -m droidmesh.services.receiver`: config -> logging -> run until SIGTERM / SIGINT (`shared/service/runtime.py`)."""

from __future__ import annotations

import sys

from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.service import ReceiverService
from droidmesh.shared.service.runtime import main

if __name__ == "__main__":
    main(ReceiverConfig, "receiver", ReceiverService, sys.argv[1:])
