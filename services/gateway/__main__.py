"""`python -m droidmesh.services.gateway`: config -> logging -> run until SIGTERM / SIGINT (`shared/service/runtime.py`)."""

from __future__ import annotations

import sys

from droidmesh.services.gateway.config import GatewayConfig
from droidmesh.services.gateway.service import GatewayService
from droidmesh.shared.service.runtime import main

if __name__ == "__main__":
    main(GatewayConfig, "gateway", GatewayService, sys.argv[1:])
