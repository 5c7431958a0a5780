"""`python -m services.sender`: config -> logging -> run until SIGTERM."""

from __future__ import annotations

import asyncio
import sys

from services.sender.config import SenderConfig
from services.sender.service import SenderService
from shared import settings
from shared.log import configure_logging
from shared.service_kit import run_until_signalled


def main(argv: list[str] | None = None) -> None:
    cfg = settings.load(SenderConfig, "sender", argv)
    configure_logging("sender", cfg.log_level)
    asyncio.run(run_until_signalled(SenderService(cfg)))


if __name__ == "__main__":
    main(sys.argv[1:])
