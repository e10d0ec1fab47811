"""Node runtime: the event loop, coordinator client, peer server, transports and collectives."""
