"""Every NATS subject, stream and bucket name DroidMesh uses, in one place.

Events (publish / subscribe, no reply):
  CACHE_AVAILABLE   sender -> broker, receivers   a context's KV (+E) is ready to pull
  CACHE_EVICTED     sender -> broker              a context left the sender's store
  SENDER_HEARTBEAT  sender -> broker              liveness + the ids the sender holds
  BROKER_HELLO      broker -> senders             a (re)started broker: re-announce your caches
Requests (request / reply):
  BROKER_LOOKUP                broker answers (queue group: any broker copy)
  receiver_generate(model)     receivers of `model` answer (queue group: one copy per request)
  sender_generate(model), sender_prefill(model)   senders of `model` answer
  PROFILER_PROFILE             profilers answer
"""

from __future__ import annotations

import re

PREFIX = "dm"
CACHE_AVAILABLE = f"{PREFIX}.cache.available"
CACHE_EVICTED = f"{PREFIX}.cache.evicted"
SENDER_HEARTBEAT = f"{PREFIX}.cache.heartbeat"
BROKER_LOOKUP = f"{PREFIX}.broker.lookup"
BROKER_HELLO = f"{PREFIX}.broker.hello"  # a (re)started broker asks senders to re-announce
PROFILER_PROFILE = f"{PREFIX}.profiler.profile"

CONFIG_BUCKET = "dm_recompute_configs"

BROKER_QUEUE = "broker"
PROFILER_QUEUE = "profiler"

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def model_token(model_id: str) -> str:
    """A model id as one subject token (NATS tokens may not contain '.', '*', '>' or spaces)."""
    return _TOKEN.sub("_", model_id)


def receiver_generate(model_id: str) -> str:
    return f"{PREFIX}.receiver.{model_token(model_id)}.generate"


def receiver_queue(model_id: str) -> str:
    return f"receivers-{model_token(model_id)}"


def sender_generate(model_id: str) -> str:
    return f"{PREFIX}.sender.{model_token(model_id)}.generate"


def sender_prefill(model_id: str) -> str:
    return f"{PREFIX}.sender.{model_token(model_id)}.prefill"


def config_key(sender_model: str, receiver_model: str) -> str:
    """JetStream KV key of a pair's recompute config: the pair id `sender-to-receiver`, each
    model id as a token (KV keys may not contain ':')."""
    return f"{model_token(sender_model)}-to-{model_token(receiver_model)}"
