"""`python -m services.sender`: config -> logging -> run until SIGTERM / SIGINT (`shared.runtime`)."""

from __future__ import annotations

import sys

from services.sender.config import SenderConfig
from services.sender.service import SenderService
from shared.runtime import main

if __name__ == "__main__":
    main(SenderConfig, "sender", SenderService, sys.argv[1:])
