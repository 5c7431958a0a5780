"""`python -m droidmesh.services.cache_broker`: config -> logging -> run until SIGTERM / SIGINT (`shared/service/runtime.py`)."""

from __future__ import annotations

import sys

from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.service import BrokerService
from droidmesh.shared.service.runtime import main

if __name__ == "__main__":
    main(BrokerConfig, "cache_broker", BrokerService, sys.argv[1:])
