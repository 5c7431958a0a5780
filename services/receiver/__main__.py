"""`python -m services.receiver`: config -> logging -> run until SIGTERM."""

from __future__ import annotations

import asyncio
import sys

from services.receiver.config import ReceiverConfig
from services.receiver.service import ReceiverService
from shared import settings
from shared.log import configure_logging
from shared.service_kit import run_until_signalled


def main(argv: list[str] | None = None) -> None:
    cfg = settings.load(ReceiverConfig, "receiver", argv)
    configure_logging("receiver", cfg.log_level)
    asyncio.run(run_until_signalled(ReceiverService(cfg)))


if __name__ == "__main__":
    main(sys.argv[1:])
