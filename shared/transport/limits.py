"""What one pull request may ask, checked before it is acted on (`answer.check_request`); torch-free,
so a sender's sandbox processes bound what they read by the same numbers."""

# Limits checked before a request is acted on. A frame's declared length is checked before it is
# read; the counts bound what one request can make the server do (items are distinct, so a real
# request has at most 3 per layer: K, V and E).
MAX_REQUEST_BYTES = 64 << 10  # a 1,024-layer model's full request is ~40 KiB
MAX_LAYERS = 1024
MAX_ITEMS = 3 * MAX_LAYERS
MAX_TOKENS = 1 << 22  # context tokens: above any model's positions
MAX_STR = 256  # context id, token, codec name, codec param keys and string values
MAX_CODEC_PARAMS = 16
