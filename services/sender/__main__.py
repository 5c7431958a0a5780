"""`python -m droidmesh.services.sender`: config -> logging -> run until SIGTERM / SIGINT (`shared/service/runtime.py`)."""

from __future__ import annotations

import sys

from droidmesh.services.sender.config import SenderConfig
from droidmesh.services.sender.service import SenderService
from droidmesh.shared.service.runtime import main

if __name__ == "__main__":
    main(SenderConfig, "sender", SenderService, sys.argv[1:])
