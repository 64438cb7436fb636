"""Many models in one allocation: one endpoint, one engine process per model, a router
that keeps as many awake as fit and swaps the rest in on demand."""
