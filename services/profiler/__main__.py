"""`python -m services.profiler`: config -> logging -> run until SIGTERM / SIGINT (`shared.runtime`)."""

from __future__ import annotations

import sys

from services.profiler.config import ProfilerConfig
from services.profiler.service import ProfilerService
from shared.runtime import main

if __name__ == "__main__":
    main(ProfilerConfig, "profiler", ProfilerService, sys.argv[1:])
