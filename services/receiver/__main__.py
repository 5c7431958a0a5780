"""`python -m services.receiver`: config -> logging -> run until SIGTERM / SIGINT (`shared.runtime`)."""

from __future__ import annotations

import sys

from services.receiver.config import ReceiverConfig
from services.receiver.service import ReceiverService
from shared.runtime import main

if __name__ == "__main__":
    main(ReceiverConfig, "receiver", ReceiverService, sys.argv[1:])
