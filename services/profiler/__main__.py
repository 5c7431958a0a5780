"""`python -m droidmesh.services.profiler`: config -> logging -> run until SIGTERM / SIGINT (`shared/service/runtime.py`)."""

from __future__ import annotations

import sys

from droidmesh.services.profiler.config import ProfilerConfig
from droidmesh.services.profiler.service import ProfilerService
from droidmesh.shared.service.runtime import main

if __name__ == "__main__":
    main(ProfilerConfig, "profiler", ProfilerService, sys.argv[1:])
