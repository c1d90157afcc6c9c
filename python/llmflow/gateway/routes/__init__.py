"""HTTP and WebSocket routes: thin adapters from FastAPI to the gateway's services."""
