"""Every NATS subject, stream and bucket name DroidMesh uses, in one place.

Events (publish / subscribe, no reply):
  cache_available(sender)   sender -> broker              a context's KV (+E) is ready to pull
  sender_endpoint(sender)   sender -> receivers           where its bulk channel is (no token ids:
    receivers only warm connections; the token ids of every scope's contexts are the broker's)
  cache_evicted(sender)     sender -> broker              a context left the sender's store
  sender_heartbeat(sender)  sender -> broker              liveness + the ids the sender holds
    Each sender publishes under its own last token (`dm.cache.<kind>.<sender>`), so NATS
    permissions can pin a sender user to its own token and the broker refuses an event whose
    `sender_id` is not the subject's: a sender speaks only for itself.
  BROKER_HELLO      broker -> senders             a (re)started broker: re-announce your caches
Requests (request / reply):
  BROKER_LOOKUP                broker answers (queue group: any broker copy)
  receiver_generate(model)     receivers of `model` answer (queue group: one copy per request)
  sender_generate(model), sender_prefill(model)   senders of `model` answer
  PROFILER_PROFILE             profilers answer operators (admin)
  profiler_reprofile(model)    profilers answer the receivers of `model` (drift re-profiles): only
    user receiver-<model> may publish there, so the subject tells the profiler who is asking
"""

from __future__ import annotations

import re

PREFIX = "dm"
CACHE_AVAILABLE = f"{PREFIX}.cache.available"
CACHE_EVICTED = f"{PREFIX}.cache.evicted"
SENDER_HEARTBEAT = f"{PREFIX}.cache.heartbeat"
SENDER_GRANT = f"{PREFIX}.grant"
BROKER_LOOKUP = f"{PREFIX}.broker.lookup"
BROKER_HELLO = f"{PREFIX}.broker.hello"  # a (re)started broker asks senders to re-announce
PROFILER_PROFILE = f"{PREFIX}.profiler.profile"
PROFILER_REPROFILE = f"{PREFIX}.profiler.reprofile"
CACHE_EVENTS = f"{PREFIX}.cache.*.*"  # every sender's events (the broker)
CACHE_AVAILABLE_ALL = f"{CACHE_AVAILABLE}.*"  # every sender's availability events (operators' tools)
SENDER_ENDPOINT = f"{PREFIX}.endpoint"  # outside dm.cache.*: the broker does not take it as a cache event
SENDER_ENDPOINT_ALL = f"{SENDER_ENDPOINT}.*"  # every sender's bulk endpoint (receivers' warm-up)
SENDER_GRANT_ALL = f"{SENDER_GRANT}.*"  # any sender's grants (receivers ask whichever holds a context)
RECEIVER_GENERATE_ALL = f"{PREFIX}.receiver.*.generate"  # any model's receivers (clients, the gateway)
PROFILER_REPROFILE_ALL = f"{PROFILER_REPROFILE}.*"  # every model's receivers' re-profiles (the profiler)

CONFIG_BUCKET = "dm_recompute_configs"
MAPS_BUCKET = "dm_scd_maps"  # SCD maps files named by sha256, chunked (shared/mesh/maps_store.py)
QUOTA_BUCKET = "dm_gateway_quotas"  # API keys' rate buckets, shared by gateway replicas (shared/auth/quota_nats.py)

BROKER_QUEUE = "broker"
PROFILER_QUEUE = "profiler"

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def model_token(model_id: str) -> str:
    """A model id as one subject token (NATS tokens may not contain '.', '*', '>' or spaces)."""
    return _TOKEN.sub("_", model_id)


def agent_work(agent: str) -> str:
    """Where `droidmesh agents` hands an agent its work (shared/tools/apps/agents.py)."""
    return f"{PREFIX}.agents.{model_token(agent)}"


def receiver_generate(model_id: str) -> str:
    return f"{PREFIX}.receiver.{model_token(model_id)}.generate"


def receiver_queue(model_id: str) -> str:
    return f"receivers-{model_token(model_id)}"


def profiler_reprofile(model_id: str) -> str:
    """Where the receivers of `model_id` ask the profiler for a re-profile of their pairs."""
    return f"{PROFILER_REPROFILE}.{model_token(model_id)}"


def sender_generate(model_id: str) -> str:
    return f"{PREFIX}.sender.{model_token(model_id)}.generate"


def sender_prefill(model_id: str) -> str:
    return f"{PREFIX}.sender.{model_token(model_id)}.prefill"


def config_key(sender_model: str, receiver_model: str) -> str:
    """JetStream KV key of a pair's recompute config: the pair id `sender-to-receiver`, each
    model id as a token (KV keys may not contain ':')."""
    return f"{model_token(sender_model)}-to-{model_token(receiver_model)}"


def cache_available(sender_id: str) -> str:
    return f"{CACHE_AVAILABLE}.{model_token(sender_id)}"


def sender_endpoint(sender_id: str) -> str:
    return f"{SENDER_ENDPOINT}.{model_token(sender_id)}"


def cache_evicted(sender_id: str) -> str:
    return f"{CACHE_EVICTED}.{model_token(sender_id)}"


def sender_grant(sender_id: str) -> str:
    """Where a receiver asks one sender (by id, not model: the holder) for a pull grant."""
    return f"{SENDER_GRANT}.{model_token(sender_id)}"


def sender_heartbeat(sender_id: str) -> str:
    return f"{SENDER_HEARTBEAT}.{model_token(sender_id)}"


def sender_token(subject: str) -> str:
    """The sender a per-sender event subject names (its last token)."""
    return subject.rsplit(".", 1)[-1]


INBOX_PREFIX = "_INBOX"  # nats-py's default; a connection without a user keeps it


def inbox_prefix(user: str) -> str:
    """The reply-inbox prefix of NATS user `user`: `_INBOX_<user>`. The server lets each user
    subscribe only under its own prefix, so no principal can read another's replies."""
    return f"{INBOX_PREFIX}_{model_token(user)}" if user else INBOX_PREFIX
