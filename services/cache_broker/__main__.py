"""`python -m services.cache_broker`: config -> logging -> run until SIGTERM."""

from __future__ import annotations

import asyncio
import sys

from services.cache_broker.config import BrokerConfig
from services.cache_broker.service import BrokerService
from shared import settings
from shared.log import configure_logging
from shared.service_kit import run_until_signalled


def main(argv: list[str] | None = None) -> None:
    cfg = settings.load(BrokerConfig, "cache_broker", argv)
    configure_logging("cache_broker", cfg.log_level)
    asyncio.run(run_until_signalled(BrokerService(cfg)))


if __name__ == "__main__":
    main(sys.argv[1:])
