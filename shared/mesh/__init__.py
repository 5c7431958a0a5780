"""The control plane over NATS: the bus, the mesh client, the config board and maps store, discovery and the NATS users."""
