"""`python -m services.profiler`: config -> logging -> run until SIGTERM."""

from __future__ import annotations

import asyncio
import sys

from services.profiler.config import ProfilerConfig
from services.profiler.service import ProfilerService
from shared import settings
from shared.log import configure_logging
from shared.service_kit import run_until_signalled


def main(argv: list[str] | None = None) -> None:
    cfg = settings.load(ProfilerConfig, "profiler", argv)
    configure_logging("profiler", cfg.log_level)
    asyncio.run(run_until_signalled(ProfilerService(cfg)))


if __name__ == "__main__":
    main(sys.argv[1:])
