"""The wire vocabulary: typed msgpack schemas (`schemas`) and NATS subjects (`subjects`)."""
